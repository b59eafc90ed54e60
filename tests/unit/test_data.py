"""colo.data.tasks (synthetic task files) and colo.data.prompts (PromptDataset)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from colo.data.prompts import PromptDataset, read_rows
from colo.data.tasks import completion, generate, make_task, sft_examples
from colo.algo.rewards import extract_answer


@pytest.fixture(scope="module")
def tok():
    from colo.models.tokenizer import build_tokenizer

    return build_tokenizer(512)


def test_arith_files_deterministic_and_correct(tmp_path: Path) -> None:
    tr, ev = make_task("arith", tmp_path / "a", n_train=300, n_eval=50, seed=7)
    tr2, ev2 = make_task("arith", tmp_path / "b", n_train=300, n_eval=50, seed=7)
    assert tr.read_bytes() == tr2.read_bytes() and ev.read_bytes() == ev2.read_bytes()
    tr3, _ = make_task("arith", tmp_path / "c", n_train=300, n_eval=50, seed=8)
    assert tr3.read_bytes() != tr.read_bytes()
    rows = [json.loads(l) for l in tr.read_text().splitlines()]
    assert len(rows) == 300 and len(ev.read_text().splitlines()) == 50
    for r in rows:
        m = re.fullmatch(r"Question: (\d)([+-])(\d)=\? Answer:", r["prompt"])
        assert m, r
        a, op, b = int(m[1]), m[2], int(m[3])
        assert int(r["answer"]) == (a + b if op == "+" else a - b)
        assert 0 <= int(r["answer"]) <= 18
    assert {r["prompt"][11] for r in rows} == {"+", "-"}  # both operations occur
    assert sft_examples(tr) == [(r["prompt"], r["answer"]) for r in rows]


def test_reverse_eval_is_held_out() -> None:
    train, evals = generate("reverse", 2000, 300, seed=0)
    assert all(a == p.split()[2][::-1] for p, a in train + evals)
    assert not {p for p, _ in train} & {p for p, _ in evals}
    with pytest.raises(ValueError, match="unknown task"):
        generate("nope", 1, 1, 0)


def test_completion_scores_with_exact_match(tok) -> None:
    # The warm-up target text, decoded back, must extract to the reference answer.
    for chat in (False, True):
        text = completion("17", chat)
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
        assert extract_answer(text) == "17"


def _write_parquet(path: Path, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


def test_jsonl_and_parquet_same_items(tmp_path: Path, tok) -> None:
    tr, _ = make_task("arith", tmp_path, n_train=20, n_eval=2, seed=0)
    rows = [json.loads(l) for l in tr.read_text().splitlines()]
    _write_parquet(tmp_path / "t.parquet", rows)
    a = PromptDataset(tr, "prompt", "answer", tok, chat_template=False, seed=3)
    b = PromptDataset(tmp_path / "t.parquet", "prompt", "answer", tok, chat_template=False, seed=3)
    ba, bb = a.next_batch(7), b.next_batch(7)
    assert ba == bb
    for item in ba:
        assert tok.decode(item["prompt_ids"]) == item["prompt_text"]
        assert item["prompt_text"].startswith("Question: ") and item["answer"].isdigit()
    c = PromptDataset(tr, "prompt", "answer", tok, chat_template=True, seed=3)
    item = c.next_batch(1)[0]
    assert item["prompt_text"].startswith("<|im_start|>user\nQuestion: ")
    assert item["prompt_text"].endswith("<|im_start|>assistant\n")
    assert item["prompt_ids"][0] == tok.convert_tokens_to_ids("<|im_start|>")


def test_missing_field_names_file_row_and_field(tmp_path: Path, tok) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"prompt": "a", "answer": "1"}\n\n{"prompt": "b", "answer": "2"}\n{"prompt": "c"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl: row 2 \(line 4\): missing field 'answer'"):
        PromptDataset(p, "prompt", "answer", tok, chat_template=False)
    q = tmp_path / "bad.parquet"
    _write_parquet(q, [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": None}])
    with pytest.raises(ValueError, match=r"bad\.parquet: row 1: missing field 'answer'"):
        PromptDataset(q, "prompt", "answer", tok, chat_template=False)
    with pytest.raises(ValueError, match=r"row 0: missing field 'question'"):
        read_rows(q, ["question"])
    p.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", \n')
    with pytest.raises(ValueError, match=r"row 1 \(line 2\): invalid JSON"):
        read_rows(p, ["prompt"])
    with pytest.raises(FileNotFoundError, match="nothere.jsonl"):
        read_rows(tmp_path / "nothere.jsonl", ["prompt"])


def test_epochs_are_permutations_and_resume_is_exact(tmp_path: Path, tok) -> None:
    p = tmp_path / "d.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": str(i)}) + "\n" for i in range(10)))
    ds = PromptDataset(p, "prompt", "answer", tok, chat_template=False, seed=1)
    first = [x["answer"] for x in ds.next_batch(4)]
    state = ds.state_dict()
    rest = [x["answer"] for b in (3, 6, 9) for x in ds.next_batch(b)]  # crosses into epochs 1 and 2
    seq = first + rest
    assert sorted(seq[:10], key=int) == [str(i) for i in range(10)]  # epoch 0: every row once
    assert sorted(seq[10:20], key=int) == [str(i) for i in range(10)]  # epoch 1: every row once
    assert seq[:10] != seq[10:20]  # reshuffled per epoch
    assert ds.state_dict() == {"epoch": 2, "pos": 2, "seed": 1, "num_rows": 10}

    resumed = PromptDataset(p, "prompt", "answer", tok, chat_template=False, seed=1)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON round trip
    assert [x["answer"] for x in resumed.next_batch(18)] == rest  # batch sizes do not change the order

    other = PromptDataset(p, "prompt", "answer", tok, chat_template=False, seed=2)
    assert [x["answer"] for x in other.next_batch(10)] != seq[:10]
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(state)
    assert [x["answer"] for b in other.sequential(4) for x in b] == [str(i) for i in range(10)]


def test_hf_datasets_from_save_to_disk_with_renamed_columns(tmp_path: Path, tok) -> None:
    import datasets

    from colo.data.prompts import DataSource
    from colo.config import ConfigError, load_config, validate

    rows = {"question": ["Question: 1+2=? Answer:", "Question: 4-1=? Answer:"], "final": ["3", "3"],
            "extra": ["x", "y"]}
    datasets.Dataset.from_dict(rows).save_to_disk(tmp_path / "single")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows),
                          "test": datasets.Dataset.from_dict({k: v[:1] for k, v in rows.items()})}
                         ).save_to_disk(tmp_path / "dict")
    assert DataSource.parse("openai/gsm8k:main:train") == DataSource("hub", "openai/gsm8k", "main", "train")
    assert DataSource.parse(f"{tmp_path}/dict:test") == DataSource("disk", f"{tmp_path}/dict", None, "test")
    for spec, n in ((f"{tmp_path}/single", 2), (f"{tmp_path}/dict:train", 2), (f"{tmp_path}/dict:test", 1)):
        ds = PromptDataset(spec, "question", "final", tok, seed=0)
        assert len(ds) == n and ds.next_batch(1)[0]["answer"] == "3"
    with pytest.raises(ValueError, match=r"splits \['test', 'train'\].*fix: .*dict:test"):
        read_rows(f"{tmp_path}/dict", ["question", "final"])
    with pytest.raises(ValueError, match="no column 'prompt'"):
        read_rows(f"{tmp_path}/single", ["prompt", "final"])
    # --dry-run's preview reads a Hub dataset from the cache only: no network here, and no ~25 s of retries
    with pytest.raises(ValueError, match=r"openai/gsm8k:main:train is not in this machine's datasets cache"):
        read_rows("openai/gsm8k:main:train", ["question", "answer"], cache_only=True)
    # the config check sees the same: before anything is written or started
    good = load_config(None, [f"data.path={tmp_path}/dict:train", "data.prompt_key=question",
                              "data.answer_key=final", "data.eval_path=null", f"run.dir={tmp_path}/r"], {})
    validate(good)
    for path, hint in ((f"{tmp_path}/dict", "needs a split"), (f"{tmp_path}/single:train", "no splits")):
        with pytest.raises(ConfigError, match=hint):
            validate(load_config(None, [f"data.path={path}", "data.prompt_key=question", "data.answer_key=final",
                                        f"run.dir={tmp_path}/r"], {}))


def test_chat_template_and_system_prompt(tok) -> None:
    from colo.data.prompts import encode_prompt
    from colo.models.tokenizer import build_tokenizer

    text, ids = encode_prompt(tok, "Question: 1+2=? Answer:", True, "Answer briefly.")
    assert text == ("<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nQuestion: 1+2=? Answer:"
                    "<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(ids) == text
    assert encode_prompt(tok, "Q", True)[0] == "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n"
    base = build_tokenizer(512)
    base.chat_template = None  # a base model's tokenizer
    from colo.config import ConfigError, load_config
    from colo.data.inputs import uses_chat_template

    cfg = load_config(None, [], {})
    assert uses_chat_template(cfg, tok) and not uses_chat_template(cfg, base)  # base models: raw text
    cfg.data.system_prompt = "Answer briefly."
    with pytest.raises(ConfigError, match="no chat template"):
        uses_chat_template(cfg, base)


def test_chat_format_prompts_and_nested_answers_as_verl_writes_them(tmp_path: Path, tok) -> None:
    """verl's GSM8K parquet: `prompt` a list of {role, content} messages, the answer in reward_model.ground_truth.
    Refused until 2026-12-08 ("holds a list ... not text"). The messages go through the chat template (a system
    message of their own keeps data.system_prompt out), rewards and environments get the last user turn as the
    prompt, environments also the messages; the warm-up renders them as the rollouts do."""
    from colo.config import ConfigError, load_config, validate
    from colo.data.inputs import preview_prompt
    from colo.data.prompts import encode_prompt
    from colo.envs.base import Environment

    system = {"role": "system", "content": "Answer with the number."}
    rows = [{"data_source": "arith", "prompt": [system, {"role": "user", "content": f"Question: {i}+1=? Answer:"}],
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)}, "extra_info": {"index": i}}
            for i in range(6)]
    _write_parquet(tmp_path / "verl.parquet", rows)
    (tmp_path / "msgs.jsonl").write_text("".join(json.dumps({"messages": r["prompt"][1:], "answer": str(i + 1)}) + "\n"
                                                 for i, r in enumerate(rows)))
    ds = PromptDataset(tmp_path / "verl.parquet", "prompt", "reward_model.ground_truth", tok, chat_template=True,
                       shuffle=False, system_prompt="ignored: the messages have their own")
    item = ds.next_batch(1)[0]
    assert item["prompt_text"] == ("<|im_start|>system\nAnswer with the number.<|im_end|>\n<|im_start|>user\n"
                                   "Question: 0+1=? Answer:<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(item["prompt_ids"]) == item["prompt_text"]
    assert (item["prompt"], item["answer"], item["messages"]) == ("Question: 0+1=? Answer:", "1", rows[0]["prompt"])
    assert Environment().reset(item) == rows[0]["prompt"]  # the default first turn: the row's own messages
    flat = PromptDataset(tmp_path / "msgs.jsonl", "messages", "answer", tok, chat_template=True, shuffle=False,
                         system_prompt="Answer briefly.").item(0)  # no system message of their own: it goes first
    assert flat["prompt_text"].startswith("<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nQuestion")
    pairs = sft_examples(tmp_path / "verl.parquet", "prompt", "reward_model.ground_truth")
    assert encode_prompt(tok, pairs[0][0], True) == (item["prompt_text"], item["prompt_ids"]) and pairs[0][1] == "1"
    with pytest.raises(ValueError, match="chat-format prompts .* need the tokenizer's chat template"):
        PromptDataset(tmp_path / "verl.parquet", "prompt", "reward_model.ground_truth", tok).item(0)
    # the config checks and --dry-run see the same, before anything starts
    overrides = [f"data.path={tmp_path}/verl.parquet", "data.eval_path=null", f"run.dir={tmp_path}/r",
                 "data.answer_key=reward_model.ground_truth"]
    cfg = load_config(None, overrides, {})
    validate(cfg)
    assert repr(item["prompt_text"]) in preview_prompt(cfg)
    _write_parquet(tmp_path / "bad.parquet", [{"prompt": ["just", "strings"], "answer": "1"}])
    with pytest.raises(ConfigError, match="holds list<element: string> values, not text or chat messages"):
        validate(load_config(None, [f"data.path={tmp_path}/bad.parquet", "data.eval_path=null",
                                    f"run.dir={tmp_path}/r"], {}))
    with pytest.raises(ValueError, match=r"row 0: missing field 'reward_model.truth'"):
        read_rows(tmp_path / "verl.parquet", ["prompt", "reward_model.truth"])
    # the answer's column named whole: every reward would score its text, 0, and nothing would say so
    whole = load_config(None, [*overrides[:-1], "data.answer_key=reward_model"], {})
    with pytest.raises(ConfigError, match=r"row 0: field 'reward_model' holds fields \['ground_truth', 'style'\], "
                                          r"not an answer .* fix: data.answer_key=reward_model.ground_truth"):
        validate(whole)
    (tmp_path / "aliases.jsonl").write_text(json.dumps({"prompt": "Capital of France?", "answer": ["Paris", "paris"]}))
    with pytest.raises(ValueError, match=r"row 0 \(line 1\): field 'answer' is a list \['Paris', 'paris'\], not one"):
        PromptDataset(tmp_path / "aliases.jsonl", "prompt", "answer", tok)


def test_a_tokenizer_without_a_pad_token_pads_with_its_eos(tmp_path: Path) -> None:
    """Llama 3's and many base models' tokenizers define no pad token: the warm-up's first batch died in
    torch.full(..., None) after Ray had started. Padded positions are masked, so the end-of-sequence id serves."""
    from colo.data.inputs import RunInputs
    from colo.data.prompts import pad_id
    from colo.models.tokenizer import build_tokenizer

    tok = build_tokenizer(512)
    tok.pad_token = None
    assert tok.pad_token_id is None and pad_id(tok) == tok.eos_token_id == 2
    inputs = RunInputs(tmp_path, tok, None, [], [("Question: 1+2=? Answer:", "3"), ("Question: 11+2=? Answer:", "13")])
    batch = inputs.sft_batch(4, 0)
    assert batch["input_ids"].shape[0] == 4 and bool((batch["input_ids"][batch["attention_mask"] == 0] == 2).all())


def test_load_tokenizer_is_autotokenizers_without_its_imports(tmp_path: Path) -> None:
    """load_tokenizer gives what AutoTokenizer gives for a generic fast tokenizer, under the name transformers 5
    writes and the one colo's tiny models write (4.x's), without importing transformers' auto classes and
    torch on the driver's start-up path; a tokenizer_config.json that names another class goes through
    AutoTokenizer."""
    import subprocess
    import sys

    from transformers import AutoTokenizer

    from colo.data.prompts import load_tokenizer
    from colo.models.tiny import TOKENIZER_VOCAB
    from colo.models.tokenizer import build_tokenizer

    def saved(name: str, tokenizer_class: str | None) -> Path:
        build_tokenizer(TOKENIZER_VOCAB).save_pretrained(tmp_path / name)
        path = tmp_path / name / "tokenizer_config.json"
        if tokenizer_class:
            path.write_text(json.dumps({**json.loads(path.read_text()), "tokenizer_class": tokenizer_class}))
        return tmp_path / name

    heavy = ("torch", "transformers.generation", "transformers.models.auto.tokenization_auto",
             "transformers.models.auto.configuration_auto")  # what AutoTokenizer's path imports: ~3 CPU-s
    probe = ("import sys; from colo.data.prompts import load_tokenizer; load_tokenizer(sys.argv[1]); "
             f"print([m for m in {heavy!r} if m in sys.modules])")
    chat = [{"role": "user", "content": "12 + 3 ="}]
    for generic in (saved("v5", None), saved("v4", "PreTrainedTokenizerFast")):
        p = subprocess.run([sys.executable, "-c", probe, str(generic)], capture_output=True, text=True)
        assert p.returncode == 0 and p.stdout.strip() == "[]", (generic.name, p.stdout, p.stderr[-2000:])
        ours, auto = load_tokenizer(generic), AutoTokenizer.from_pretrained(generic)
        assert type(ours) is type(auto)
        assert ours.apply_chat_template(chat, add_generation_prompt=True) == \
            auto.apply_chat_template(chat, add_generation_prompt=True)
        assert ours("Question: 7 - 2 =")["input_ids"] == auto("Question: 7 - 2 =")["input_ids"]
        assert (ours.eos_token_id, ours.pad_token_id, ours.chat_template, len(ours)) == \
            (auto.eos_token_id, auto.pad_token_id, auto.chat_template, len(auto))

    named = saved("named", "Qwen2Tokenizer")
    assert type(load_tokenizer(named)) is type(AutoTokenizer.from_pretrained(named)) is not type(auto)
