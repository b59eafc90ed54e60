"""A packed row (samples back to back, position ids restarting) gives each sample the hidden states it gets
alone: with colo's sdpa_varlen (per-sample SDPA, no N x N mask) and with transformers' own sdpa and eager,
which build a block-diagonal mask from the position ids (transformers' masking_utils)."""
import pytest
import torch

from colo.algo.packing import Packed, pack_bins
from colo.models.tiny import preset_config
from colo.trainer.attention import register


@pytest.fixture(scope="module")
def models():
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = preset_config("tiny")
    base = Qwen3MoeForCausalLM(cfg).float().eval()
    out = {}
    for impl in ("sdpa", "eager", register()):
        cfg = preset_config("tiny")
        cfg._attn_implementation = impl
        m = Qwen3MoeForCausalLM(cfg).float().eval()
        m.load_state_dict(base.state_dict())
        out[impl] = m
    return out


@pytest.mark.parametrize("impl", ["sdpa_varlen", "sdpa", "eager"])
@torch.no_grad()
def test_packed_row_equals_separate_forwards(models, impl):
    model = models[impl]
    g = torch.Generator().manual_seed(1)
    lengths = [7, 1, 12, 3]
    am = torch.zeros(len(lengths), 12, dtype=torch.long)
    for b, n in enumerate(lengths):
        am[b, :n] = 1
    ids = torch.randint(3, 500, am.shape, generator=g) * am  # (b, T) right-padded with 0
    p = Packed.of(am)
    assert p.bounds == (0, 7, 8, 20, 23) and p.position_ids[0, 7:9].tolist() == [0, 0]
    extra = {"colo_bounds": p.bounds} if impl == "sdpa_varlen" else {}
    packed = model.model(input_ids=p.pack(ids), position_ids=p.position_ids, use_cache=False,
                         **extra).last_hidden_state  # (1, N, H)
    for b, n in enumerate(lengths):
        alone = models["sdpa"].model(input_ids=ids[b:b + 1, :n], use_cache=False).last_hidden_state  # (1, n, H)
        s = p.bounds[b]
        torch.testing.assert_close(packed[0, s:s + n], alone[0], rtol=1e-5, atol=1e-5)
    # the padded path's unpack puts every token back where it was
    back = torch.stack([p.unpack(packed[..., k]) for k in range(2)], -1)  # (b, T, 2)
    assert torch.equal(back[am == 0], torch.zeros_like(back[am == 0]))


@torch.no_grad()
def test_varlen_without_bounds_is_plain_sdpa(models):
    """Padded rows (a 2-D mask, no bounds) run transformers' sdpa with the mask: the same outputs as sdpa."""
    ids = torch.randint(3, 500, (2, 9), generator=torch.Generator().manual_seed(2))
    am = torch.ones(2, 9, dtype=torch.long)
    am[1, 6:] = 0
    want = models["sdpa"].model(input_ids=ids, attention_mask=am, use_cache=False).last_hidden_state
    got = models["sdpa_varlen"].model(input_ids=ids, attention_mask=am, use_cache=False).last_hidden_state
    torch.testing.assert_close(got[am.bool()], want[am.bool()], rtol=1e-5, atol=1e-5)


def test_pack_bins_as_few_as_first_fit_and_even():
    assert pack_bins([5, 9, 2, 4, 7], 10) == [[1], [2, 4], [0, 3]]  # 9; 7 + 2; 5 + 4
    assert pack_bins([30, 3], 10) == [[0], [1]]  # longer than the budget: a bin of its own
    assert pack_bins([30, 3, 4], 10) == [[0], [1, 2]]
    # first-fit decreasing fills 13, 13 and leaves 2; the same three bins hold 12, 8, 8
    lengths = [6, 6, 6, 6, 1, 1, 1, 1]
    bins = pack_bins(lengths, 13)
    assert sorted(sum(lengths[i] for i in b) for b in bins) == [8, 8, 12]
    assert sorted(i for b in bins for i in b) == list(range(8))
    # where spreading does not fit, first-fit's bins: 6 + 4 and 4 + 3 + 3 fill two bins of 10 exactly; spread
    # longest first into the roomiest bin, the last 3 finds 2 free
    assert pack_bins([6, 4, 4, 3, 3], 10) == [[0, 1], [2, 3, 4]]
    with pytest.raises(ValueError):
        pack_bins([1], 0)
