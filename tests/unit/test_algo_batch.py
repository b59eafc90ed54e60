import numpy as np
import pytest
import torch

from colo.algo.batch import balance, build_batch, shard_batch
from colo.rollout.sample import Sample, Status


def _sample(i, p, r, lp=None, status=Status.COMPLETED):
    return Sample(i, 0, 0, p, r, lp if lp is not None else [-0.5] * len(r), status=status)


def test_build_batch_alignment_by_hand():
    samples = [
        _sample(0, [11, 12, 13], [21, 22], [-0.1, -0.2]),
        _sample(1, [31], [41, 42, 43, 44], [-1.0, -2.0, -3.0, -4.0]),
    ]
    b = build_batch(samples, [0.5, -0.5], pad_id=7)
    torch.testing.assert_close(b["input_ids"], torch.tensor([[11, 12, 13, 21, 22],
                                                             [31, 41, 42, 43, 44]]))
    torch.testing.assert_close(b["attention_mask"], torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]))
    torch.testing.assert_close(b["loss_mask"], torch.tensor([[0., 0., 0., 1., 1.], [0., 1., 1., 1., 1.]]))
    # value at t is log p(ids[t] | ids[:t]): response token logprobs sit on the response tokens
    torch.testing.assert_close(b["rollout_logprobs"], torch.tensor([[0., 0., 0., -0.1, -0.2],
                                                                    [0., -1., -2., -3., -4.]]))
    torch.testing.assert_close(b["advantages"], torch.tensor([0.5, -0.5]))
    assert b["input_ids"].dtype == torch.long and b["loss_mask"].dtype == torch.float32
    torch.testing.assert_close(b["sample_index"], torch.tensor([0, 1]))


def test_build_batch_right_padding_and_multiple():
    b = build_batch([_sample(0, [1, 2], [3]), _sample(0, [4], [5, 6, 7, 8])], [1.0, 2.0],
                    pad_id=0, pad_to_multiple=4)
    assert b["input_ids"].shape == (2, 8)
    torch.testing.assert_close(b["input_ids"][0], torch.tensor([1, 2, 3, 0, 0, 0, 0, 0]))
    torch.testing.assert_close(b["attention_mask"][0], torch.tensor([1, 1, 1, 0, 0, 0, 0, 0]))
    torch.testing.assert_close(b["loss_mask"][0], torch.tensor([0., 0., 1., 0., 0., 0., 0., 0.]))
    assert b["loss_mask"].sum() == 5


def test_build_batch_rejects_mismatches():
    with pytest.raises(ValueError, match="2 response tokens but 1 logprobs"):
        build_batch([_sample(0, [1], [2, 3], [-1.0])], [0.0])
    with pytest.raises(ValueError, match="1 samples but 2 advantages"):
        build_batch([_sample(0, [1], [2])], [0.0, 1.0])
    with pytest.raises(ValueError, match="empty prompt"):
        build_batch([_sample(0, [], [2])], [0.0])


def test_balance_counts_and_tokens():
    lengths = [10, 9, 8, 7, 2, 1, 1]
    groups = balance(lengths, 3)
    assert sorted(i for g in groups for i in g) == list(range(7))
    assert sorted(len(g) for g in groups) == [2, 2, 3]
    totals = sorted(sum(lengths[i] for i in g) for g in groups)
    assert totals == [11, 12, 15]  # longest-first under count caps: {10,1} {9,2} {8,7}
    assert balance(lengths, 3) == groups  # deterministic
    assert balance([5, 5], 4) == [[0], [1], [], []]


def test_shards_cover_every_sample_once_and_keep_advantages():
    samples = [_sample(i // 2, [1] * (1 + i % 3), [2] * (1 + i)) for i in range(7)]
    adv = torch.arange(7, dtype=torch.float32) + 1
    shards = shard_batch(build_batch(samples, adv), 2)  # as colo.loop.rl_step shards a step's batch
    seen = torch.cat([s["sample_index"] for s in shards]).tolist()
    assert sorted(seen) == [-1] + list(range(7)) and [len(s["sample_index"]) for s in shards] == [4, 4]
    for s in shards:
        for row, i in enumerate(s["sample_index"].tolist()):
            if i == -1:  # the padding row that evens out the counts
                assert s["loss_mask"][row].sum() == 0 and s["advantages"][row] == 0
                continue
            assert s["advantages"][row] == adv[i]
            assert s["loss_mask"][row].sum() == len(samples[i].response_ids)
        # each shard pads to its own longest row
        assert s["input_ids"].shape[1] == int(s["attention_mask"].sum(1).max())


def test_shards_pad_ranks_without_samples():
    samples = [_sample(0, [1, 2], [3, 4], [-0.3, -0.4])]
    shards = shard_batch(build_batch(samples, [1.5]), 3)
    assert len(shards) == 3
    assert shards[0]["sample_index"].tolist() == [0] and shards[0]["loss_mask"].sum() == 2
    for pad in shards[1:]:
        assert pad["sample_index"].tolist() == [-1]
        assert pad["loss_mask"].sum() == 0 and pad["advantages"].tolist() == [0.0]
        assert pad["attention_mask"].sum() == 4  # a real forward pass, not an empty one


def test_shard_batch_generic_over_keys_and_trims_padding():
    # an SFT-style batch: no advantages / rollout log-probs, plus a (B, T) key the shards must trim
    ids = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 0, 0, 0, 0], [9, 9, 9, 0, 0, 0]])
    attn = (ids != 0).long()
    batch = {"input_ids": ids, "attention_mask": attn, "loss_mask": attn.float(),
             "labels": ids * 10, "note": "kept"}
    a, b = shard_batch(batch, 2)
    assert a["input_ids"][0].tolist() == [1, 2, 3, 4, 5, 6]  # longest alone, 6 tokens vs 3 + 2
    assert b["input_ids"].tolist() == [[7, 8, 0], [9, 9, 9]]  # trimmed to its own longest row
    assert b["labels"].tolist() == [[70, 80, 0], [90, 90, 90]] and b["note"] == "kept"
    # equal row counts on every rank: a's missing row is a zero-mask copy of the shortest row
    assert a["loss_mask"].tolist() == [[1.0] * 6, [0.0] * 6]
    assert a["input_ids"][1].tolist() == [7, 8, 0, 0, 0, 0]
    assert batch["loss_mask"].sum() == 11  # the global batch is untouched
    shards = shard_batch(batch, 4)
    assert [s["input_ids"].shape for s in shards] == [(1, 6), (1, 3), (1, 2), (1, 2)]
    assert shards[3]["loss_mask"].sum() == 0 and shards[2]["loss_mask"].sum() == 2


def test_mask_truncated_drops_only_length_stopped_samples_from_the_loss():
    samples = [_sample(0, [1, 2], [3, 4]), _sample(0, [1, 2], [5, 6, 7], status=Status.TRUNCATED)]
    kept = build_batch(samples, [1.0, -1.0])
    dropped = build_batch(samples, [1.0, -1.0], mask_truncated=True)
    torch.testing.assert_close(kept["loss_mask"][1], torch.tensor([0., 0., 1., 1., 1.]))
    torch.testing.assert_close(dropped["loss_mask"], torch.tensor([[0., 0., 1., 1., 0.], [0.] * 5]))
    for key in ("input_ids", "attention_mask", "advantages", "rollout_logprobs"):
        assert torch.equal(kept[key], dropped[key]), key  # still in the batch, just no loss


def test_wire_format_round_trips_a_batch() -> None:
    from colo.algo.batch import from_wire, to_wire

    batch = {"input_ids": torch.arange(6).view(2, 3), "loss_mask": torch.ones(2, 3),
             "routed": torch.zeros(2, 3, 4, dtype=torch.uint8), "bf16": torch.ones(2, dtype=torch.bfloat16),
             "note": "kept"}
    wire = to_wire(batch)
    assert isinstance(wire["input_ids"], np.ndarray) and torch.is_tensor(wire["bf16"]) and wire["note"] == "kept"
    for a in wire.values():  # Ray hands arrays over read-only: from_wire must not keep them
        if isinstance(a, np.ndarray):
            a.setflags(write=False)
    back = from_wire(wire)
    for k, v in batch.items():
        assert back[k] == v if k == "note" else (torch.equal(back[k], v) and back[k].dtype == v.dtype), k
    back["loss_mask"][0, 0] = 5.0  # a tensor of its own: writable, and the wire's array is untouched
    assert wire["loss_mask"][0, 0] == 1.0
    assert all(from_wire(back)[k] is back[k] for k in back)  # tensors pass as they are
