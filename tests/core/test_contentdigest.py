"""The weight digest has no structured blind spot: sign flips in pairs, swapped words, equal and opposite
changes, a column or a row negated, and random edits all change it — on the CPU (xxh3 over the bytes) and on the
device path (mixed words summed where the tensor lives, run here on CPU tensors)."""

import pytest
import torch

from offload_core.reuse.contentdigest import content_digest, device_sum


def _cpu(t):
    return content_digest([t])


def _device(t):
    return int(device_sum(t))


DIGESTS = {"cpu": _cpu, "device": _device}


def _weight(dtype, rows=8, cols=6):
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(1)).to(dtype)


def _as_int(t):
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _neg_column(t):
    t[:, 1 if t.element_size() == 4 else 3].neg_()  # bit 63 of an even number of 64-bit words


def _neg_row(t):
    t[1].neg_()


def _sign_pair(t):
    flat = _as_int(t.view(-1))
    per_word = 8 // t.element_size()
    top = torch.tensor(1 << (8 * t.element_size() - 1)).to(flat.dtype)
    for i in (per_word - 1, 5 * per_word - 1):  # the top bit of words 0 and 4
        flat[i] ^= top


def _swap_words(t):
    words = t.view(-1).view(torch.uint8).view(torch.int64)
    words[[0, 3]] = words[[3, 0]].clone()


def _swap_elements(t):
    flat = t.view(-1)
    flat[[2, 7]] = flat[[7, 2]].clone()


def _equal_and_opposite(t):
    flat = _as_int(t.view(-1))
    flat[0] += 1
    flat[9] -= 1


def _equal_and_opposite_words(t):
    words = t.view(-1).view(torch.uint8).view(torch.int64)
    words[1] += 1 << 40
    words[2] -= 1 << 40


def _scale_whole_tensor_sign(t):
    t.neg_()


EDITS = [_neg_column, _neg_row, _sign_pair, _swap_words, _swap_elements, _equal_and_opposite,
         _equal_and_opposite_words, _scale_whole_tensor_sign]


@pytest.mark.parametrize("path", sorted(DIGESTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("edit", EDITS, ids=lambda e: e.__name__.strip("_"))
def test_a_structured_edit_always_changes_the_digest(edit, dtype, path):
    digest = DIGESTS[path]
    w = _weight(dtype)
    before = digest(w)
    assert digest(w.clone()) == before
    edited = w.clone()
    edit(edited)
    assert not torch.equal(_as_int(edited), _as_int(w)), "the edit changed nothing: it tests nothing"
    assert digest(edited) != before


@pytest.mark.parametrize("path", sorted(DIGESTS))
def test_random_edits_always_change_the_digest(path):
    digest = DIGESTS[path]
    rng = torch.Generator().manual_seed(3)
    w = torch.randn(64, 48, generator=rng)
    before = digest(w)
    words = w.view(-1).view(torch.int64)
    for _ in range(200):
        edited = words.clone()
        n = int(torch.randint(1, 5, (), generator=rng))
        where = torch.randint(0, words.numel(), (n,), generator=rng)
        bits = torch.randint(0, 64, (n,), generator=rng)
        for i, b in zip(where.tolist(), bits.tolist()):
            edited[i] ^= torch.tensor(1, dtype=torch.int64) << b
        if not torch.equal(edited, words):
            assert digest(edited.view(torch.float32).view(64, 48)) != before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.bool])
def test_one_changed_element_at_any_offset_and_the_order_of_tensors_count(dtype):
    x = (torch.arange(1001) % 7).to(dtype)
    for view in (x, x[1:], x[3:]):  # unaligned views
        y = view.clone()
        y[len(y) // 2] = (y[len(y) // 2] == 0).to(dtype) if dtype is torch.bool else y[len(y) // 2] + 1
        assert content_digest([view]) != content_digest([y])
        assert content_digest([view]) == content_digest([view.clone()])
        assert _device(view) != _device(y) and _device(view) == _device(view.clone())
    assert content_digest([x[:500], x[500:]]) != content_digest([x[500:], x[:500]])
    assert content_digest([x.view(1, -1)]) != content_digest([x])  # the shape counts


def test_a_non_contiguous_tensor_digests_as_its_values():
    w = _weight(torch.float32)
    assert content_digest([w.t()]) == content_digest([w.t().contiguous()])
    assert _device(w.t()) == _device(w.t().contiguous())


def test_the_device_path_sees_words_moved_between_chunks(monkeypatch):
    from offload_core.reuse import contentdigest

    monkeypatch.setattr(contentdigest, "_WORDS", 8)
    monkeypatch.setattr(contentdigest, "_KEYS", {})
    words = torch.randint(-(2 ** 62), 2 ** 62, (32,), dtype=torch.int64, generator=torch.Generator().manual_seed(5))
    moved = words.clone()
    moved[[1, 9]] = words[[9, 1]]  # the same place in chunks 0 and 1
    assert _device(moved) != _device(words)
    assert _device(words) == _device(words.clone())
