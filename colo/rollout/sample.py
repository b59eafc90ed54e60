"""One rollout sample, from its first request to the train batch: what the engine loop starts or resumes
(colo.rollout.engine_loop), what the async schedules carry (colo.rollout.buffer, colo.rollout.ahead), what the
rewards score and the batch is built from (colo.loop.score, colo.algo.batch).

    s = Sample(group=3, index=1, seed=7, prompt_ids=[...])   # fresh: nothing generated, Status.PENDING
    s.extend(ids, logprobs, version=step)                   # the engine loop, as vLLM streams tokens
    s.status                                                 # PENDING until it ends: COMPLETED, TRUNCATED or FAILED
    arrays = pack(samples); arrays.unpack()                  # over Ray and in a checkpoint

A sample is response `index` of group `group` (a prompt and its n samples: the GRPO baseline). Per response token
it keeps the token, vLLM's log-prob of it (the behaviour policy's, docs/loss.md) and the weight version that sampled
it (step s's weights: version s), so a sample resumed under newer weights (loop.mode=async) trains every token
against the policy that drew it. A conversation (algo.environment) also marks which tokens the model sampled
(`model_mask`; the environment's are never trained) and carries its turns' bookkeeping (`Turns`).

Routing rows (R3, colo.rollout.capture): `routing` holds rows routed_from .. routed_from + len of the sequence
prompt + response[:-1] (the last token is never forwarded), (rows, M, K) expert ids. The driver keeps them from row 0;
what goes to an engine carries none (`for_engine`: the rows already held stay on the driver, only their count
travels), and the engine hands back the rows of what it forwarded (`merge` joins them).

Samples cross Ray and land in a checkpoint as arrays (`SampleArrays`: one flat array per field, a few bytes a
token), never as lists of Python objects: a 32 x 8 step at 4k tokens is a million tokens.
"""
from __future__ import annotations

import base64
import copy
from dataclasses import asdict, dataclass, field
from enum import Enum

import numpy as np


class Status(str, Enum):
    PENDING = "pending"  # not ended: never started, or stopped part-way and carried (loop.mode=async)
    COMPLETED = "completed"  # EOS, a stop string, or its environment said done
    TRUNCATED = "truncated"  # its token budget (rollout.max_tokens, max_model_len) ended it
    FAILED = "failed"  # its environment raised, hung or answered something malformed (Turns.env_error)


FINISH_REASON = {Status.PENDING: None, Status.COMPLETED: "stop", Status.TRUNCATED: "length", Status.FAILED: "error"}
"""The finish reason the rewards and the metrics read (vLLM's words; "error": the environment's)."""
STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "error": Status.FAILED}
_CODES = list(Status)


@dataclass
class Turns:
    """A conversation's bookkeeping (algo.environment; colo.rollout.turns reads and updates it)."""

    spans: list[list[int]] = field(default_factory=list)  # the model's finished turns: [start, end) into response_ids
    reasons: list[str] = field(default_factory=list)  # their finish reasons (vLLM's)
    in_progress: int = 0  # tokens of a model turn still under way at the end of response_ids (carried mid-turn)
    env_reward: float = 0.0  # the sum of the environment's step rewards
    tool_calls: int = 0
    tool_errors: int = 0
    env_error: str | None = None  # what ended it with Status.FAILED
    final_ids: list[int] = field(default_factory=list)  # the model's last turn: what algo.rewards score


@dataclass
class Sample:
    group: int  # its prompt: an index into the step's prompts (the async buffer: its group id)
    index: int  # which of the group's n samples
    seed: int  # its sampling stream: the seed of its first request (colo.rollout.engine_loop.request_seed)
    prompt_ids: list[int]  # (P,); a conversation's comes from its environment's reset: [] until its first segment
    response_ids: list[int] = field(default_factory=list)  # (R,) the model's tokens and, in a conversation, the env's
    logprobs: list[float] = field(default_factory=list)  # (R,) vLLM's processed log-prob; 0.0 on the environment's
    versions: list[int] = field(default_factory=list)  # (R,) the weight version that sampled (or appended) each token
    model_mask: list[int] | None = None  # (R,) conversations: 1 where the model sampled the token
    routing: np.ndarray | None = field(default=None, repr=False)  # (rows, M, K) expert ids from row routed_from
    routed_from: int = 0
    status: Status = Status.PENDING
    segments: int = 0  # generate calls it went through (a resumed segment draws from a stream of its own)
    turns: Turns | None = None  # conversations only

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASON[self.status]

    @property
    def done(self) -> bool:
        return self.status is not Status.PENDING

    @property
    def started(self) -> bool:
        """Its prompt is known (a conversation's once its environment was reset)."""
        return bool(self.prompt_ids)

    @property
    def ids(self) -> list[int]:
        """Every token so far: what its next request prefills."""
        return self.prompt_ids + self.response_ids

    @property
    def final_ids(self) -> list[int]:
        """What algo.rewards score: the response, or a conversation's last model turn."""
        return self.turns.final_ids if self.turns is not None else self.response_ids

    @property
    def routed_rows(self) -> int:
        """Rows routed so far (held here or, for a sample on its way to an engine, on the driver)."""
        return self.routed_from + (0 if self.routing is None else len(self.routing))

    def model_versions(self) -> list[int]:
        """The versions of the tokens the model sampled (a conversation's environment tokens left out)."""
        if self.model_mask is None:
            return self.versions
        return [v for v, m in zip(self.versions, self.model_mask) if m]

    def extend(self, ids: list[int], logprobs: list[float] | None, version: int, model: bool = True) -> None:
        """Append tokens: the model's with their log-probs, or (model=False) an environment's observation."""
        if model and (logprobs is None or len(logprobs) != len(ids)):
            raise ValueError(f"{len(ids)} tokens but {0 if logprobs is None else len(logprobs)} log-probs")
        self.response_ids += ids
        self.logprobs += list(logprobs) if model else [0.0] * len(ids)
        self.versions += [version] * len(ids)
        if self.model_mask is not None:
            self.model_mask += [int(model)] * len(ids)

    def add_rows(self, rows: np.ndarray | None) -> None:
        """Routing rows of the tokens forwarded next (rows routed_rows ..); None: rows were lost, so the sample
        keeps none and its next request asks for every row again."""
        if rows is None:
            self.routing, self.routed_from = None, 0
        elif len(rows):
            self.routing = rows if self.routing is None else np.concatenate([self.routing, rows])

    def complete_routing(self) -> np.ndarray | None:
        """(P+R-1, M, K): every row of the sequence, or None when some are missing."""
        n = len(self.prompt_ids) + len(self.response_ids) - 1
        if self.routed_from == 0 and self.routing is not None and len(self.routing) == n:
            return self.routing
        return None

    def for_engine(self) -> Sample:
        """A copy to send to an engine: everything but the routing rows already held (only their count)."""
        out = copy.copy(self)
        out.response_ids, out.logprobs, out.versions = list(self.response_ids), list(self.logprobs), list(self.versions)
        out.model_mask = None if self.model_mask is None else list(self.model_mask)
        out.turns = copy.deepcopy(self.turns)
        out.routing, out.routed_from = None, self.routed_rows
        return out

    def merge(self, seg: Sample) -> None:
        """Take what an engine made of `for_engine()`'s copy: its tokens, status and turns; its rows join ours
        (rows from 0: they replace ours, none included: ours were lost)."""
        if (seg.group, seg.index) != (self.group, self.index) or seg.response_ids[:len(self.response_ids)] != \
                self.response_ids:
            raise RuntimeError(f"group {self.group} sample {self.index}: an engine's result for another sample")
        routing, held = self.routing, self.routed_rows
        self.__dict__.update(copy.copy(seg.__dict__))
        if seg.routed_from == 0:
            return  # every row again (or none)
        if seg.routed_from != held:
            raise RuntimeError(f"group {self.group} sample {self.index}: an engine routed from row {seg.routed_from}, "
                               f"{held} rows were held")
        self.routing, self.routed_from = routing, 0
        self.add_rows(seg.routing if seg.routing is not None else np.empty((0,)))


# ------------------------------------------------------------------------------ arrays: the Ray hop, the checkpoint

_INTS = ("group", "index", "seed", "segments", "routed_from")


@dataclass
class SampleArrays:
    """Samples as flat arrays: per sample `meta` (N, 10) int64, the tokens of all of them end to end. Pickles (Ray)
    as a few buffers; `state_dict` is its JSON (a checkpoint's extra.json)."""

    meta: np.ndarray  # (N, 10): group, index, seed, segments, routed_from, status, P, R, rows (-1: no routing), mask
    prompt_ids: np.ndarray  # (sum P,) int64
    response_ids: np.ndarray  # (sum R,) int64
    logprobs: np.ndarray  # (sum R,) float32: vLLM's log-probs are float32, so this is lossless
    versions: np.ndarray  # (sum R,) int64
    model_mask: np.ndarray  # (sum R of the samples with one,) int8
    routing: np.ndarray | None  # (sum rows, M, K) uint8 or int16
    turns: list[dict | None]  # Turns as a dict (small), None for a single-turn sample

    def __len__(self) -> int:
        return len(self.meta)

    def unpack(self) -> list[Sample]:
        out, p, r, m, k = [], 0, 0, 0, 0
        for row, turns in zip(self.meta.tolist(), self.turns):
            group, index, seed, segments, routed_from, status, P, R, rows, masked = row
            s = Sample(group, index, seed, self.prompt_ids[p:p + P].tolist(), self.response_ids[r:r + R].tolist(),
                       self.logprobs[r:r + R].tolist(), self.versions[r:r + R].tolist(), None, None, routed_from,
                       _CODES[status], segments, None if turns is None else Turns(**copy.deepcopy(turns)))
            if masked:
                s.model_mask = self.model_mask[m:m + R].tolist()
                m += R
            if rows >= 0:
                s.routing = self.routing[k:k + rows].copy()  # writable, its own (Ray hands arrays over read-only)
                k += rows
            out.append(s)
            p, r = p + P, r + R
        return out

    def state_dict(self) -> dict:
        """JSON-able (arrays as base64 of their bytes)."""
        arrays = {k: encode_array(getattr(self, k)) for k in ("meta", "prompt_ids", "response_ids", "logprobs",
                                                                  "versions", "model_mask")}
        return {**arrays, "routing": None if self.routing is None else encode_array(self.routing),
                "turns": copy.deepcopy(self.turns)}

    @classmethod
    def from_state(cls, state: dict) -> SampleArrays:
        arrays = {k: decode_array(state[k]) for k in ("meta", "prompt_ids", "response_ids", "logprobs", "versions",
                                                      "model_mask")}
        routing = None if state["routing"] is None else decode_array(state["routing"])
        return cls(**arrays, routing=routing, turns=copy.deepcopy(state["turns"]))


def pack(samples: list[Sample]) -> SampleArrays:
    """The samples' arrays (their order kept)."""
    meta = np.array([[*(getattr(s, k) for k in _INTS), _CODES.index(s.status), len(s.prompt_ids),
                      len(s.response_ids), -1 if s.routing is None else len(s.routing), s.model_mask is not None]
                     for s in samples], dtype=np.int64).reshape(len(samples), 10)
    routed = [s.routing for s in samples if s.routing is not None]
    return SampleArrays(
        meta, _flat([s.prompt_ids for s in samples], np.int64), _flat([s.response_ids for s in samples], np.int64),
        _flat([s.logprobs for s in samples], np.float32), _flat([s.versions for s in samples], np.int64),
        _flat([s.model_mask for s in samples if s.model_mask is not None], np.int8),
        np.concatenate(routed) if routed else None,
        [None if s.turns is None else asdict(s.turns) for s in samples])


def _flat(lists: list, dtype: type) -> np.ndarray:
    return np.fromiter((x for xs in lists for x in xs), dtype=dtype)


def encode_array(a: np.ndarray) -> dict:
    """A numpy array as JSON (base64 of its bytes)."""
    a = np.ascontiguousarray(a)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "b64": base64.b64encode(a.tobytes()).decode()}


def decode_array(d: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(d["b64"]), dtype=np.dtype(d["dtype"])).reshape(d["shape"]).copy()
