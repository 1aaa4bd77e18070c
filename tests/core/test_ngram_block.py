"""NGramBlock: --no-repeat-ngram-size that blocks repeats off CUDA, against a brute-force reference."""

import pytest
import torch

from fairseq_fp16.core.ngram_block import NGramBlock, banned_tokens


def brute_force(row, n):
    """Tokens that would complete an n-gram ``row`` already holds (n = 1: tokens after the start)."""
    if n == 1:
        return set(row[1:])
    tail = row[len(row) - n + 1:]
    return {row[i + n - 1] for i in range(len(row) - n + 1) if row[i:i + n - 1] == tail}


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_banned_tokens_are_those_completing_a_held_ngram(n):
    g = torch.Generator().manual_seed(n)
    for length in range(1, 14):
        prefix = torch.randint(0, 4, (6, length), generator=g)  # 4 symbols: many repeats
        rows, tokens = banned_tokens(prefix, n)
        got = [set() for _ in range(6)]
        for r, t in zip(rows.tolist(), tokens.tolist()):
            got[r].add(t)
        assert got == [brute_force(row, n) for row in prefix.tolist()], (n, length)


def looping_buffer():
    """Two hypotheses in a generator's buffer (start symbol 2, pad 1): the first loops on 5 6 7,
    the second does not repeat; step 7 filled, the rest padding."""
    tokens = torch.full((2, 12), 1)
    tokens[:, 0] = 2
    tokens[0, 1:8] = torch.tensor([5, 6, 7, 5, 6, 7, 5])
    tokens[1, 1:8] = torch.tensor([3, 4, 5, 6, 7, 8, 9])
    return tokens, 7


def test_the_next_token_of_a_loop_is_blocked_where_fairseqs_fallback_blocks_none():
    from fairseq.ngram_repeat_block import NGramRepeatBlock

    tokens, step = looping_buffer()
    lprobs = torch.zeros(2, 10)
    out = NGramBlock(3)(tokens, lprobs, 2, 1, step)
    assert out is lprobs  # in place, as fairseq's
    assert torch.isinf(out[0]).nonzero().flatten().tolist() == [6]  # "7 5" was followed by 6
    assert not torch.isinf(out[1]).any()
    # bigrams: "5" was followed by 6 (twice); the second row's last token, 9, by nothing
    assert NGramBlock(2)(tokens, torch.zeros(2, 10), 2, 1, step).isinf().nonzero().tolist() == [[0, 6]]
    # fairseq 0.12's fallback (no CUDA extension) compares with the buffer's padding: nothing blocked
    stock = NGramRepeatBlock(3, use_extension=False)(tokens, torch.zeros(2, 10), 2, 1, step)
    assert not torch.isinf(stock).any()


def test_rows_that_do_not_match_bsz_times_beam_are_refused():
    tokens, step = looping_buffer()
    with pytest.raises(ValueError, match=r"expected 4 rows \(bsz 2 x beam 2\), got tokens \(2, 12\)"):
        NGramBlock(3)(tokens, torch.zeros(2, 10), 2, 2, step)
