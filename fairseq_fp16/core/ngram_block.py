"""``--no-repeat-ngram-size`` that blocks repeats off CUDA too (pure torch).

fairseq 0.12's ``NGramRepeatBlock`` has a CUDA kernel and a Python fallback for
every other case. The fallback compares each earlier (n-1)-gram with the last
n-1 entries of the whole token buffer, which is padding until the hypothesis
is full, instead of with the last n-1 generated tokens; so on the CPU (and on a
GPU without the compiled extension) it blocks nothing, and greedy outputs keep
their loops (fairseq issue #5206, open). :class:`NGramBlock` is a drop-in
replacement with the same call, vectorised: it bans every token that would
complete an n-gram already in the hypothesis. ``translation_fp16``'s
``build_generator`` installs it wherever fairseq would take the fallback.
"""

from __future__ import annotations

import torch

__all__ = ["NGramBlock", "banned_tokens"]


def banned_tokens(prefix: torch.Tensor, n: int):
    """``(rows, tokens)``: for each row of ``prefix`` (hypotheses so far, the first column the
    start symbol), the tokens that would complete an n-gram the row already holds, as two
    index tensors. For ``n == 1``, every token generated so far (not the start symbol)."""
    empty = prefix.new_empty(0, dtype=torch.long)
    if n < 1 or prefix.size(1) < n:
        return empty, empty
    if n == 1:
        generated = prefix[:, 1:]
        rows = torch.arange(prefix.size(0), device=prefix.device)
        return rows.repeat_interleave(generated.size(1)), generated.reshape(-1)
    windows = prefix.unfold(1, n, 1)  # (rows, T - n + 1, n): every complete n-gram
    tail = prefix[:, prefix.size(1) - n + 1:]  # the n - 1 tokens the next one follows
    rows, starts = (windows[:, :, :-1] == tail[:, None, :]).all(-1).nonzero(as_tuple=True)
    return rows, windows[rows, starts, -1]


class NGramBlock(torch.nn.Module):
    """Sets the log-probability of every token that would repeat an n-gram to ``-inf``.

    Called as fairseq's ``NGramRepeatBlock``: ``(tokens, lprobs, bsz, beam_size, step)``,
    ``tokens`` the generator's buffer (``bsz * beam_size`` rows, filled up to column
    ``step``), ``lprobs`` the next token's scores, changed in place and returned.
    """

    def __init__(self, no_repeat_ngram_size: int):
        super().__init__()
        self.no_repeat_ngram_size = no_repeat_ngram_size

    def forward(self, tokens: torch.Tensor, lprobs: torch.Tensor, bsz: int, beam_size: int,
                step: int) -> torch.Tensor:
        if tokens.size(0) != bsz * beam_size or lprobs.size(0) != bsz * beam_size:
            raise ValueError(f"expected {bsz * beam_size} rows (bsz {bsz} x beam {beam_size}), "
                             f"got tokens {tuple(tokens.shape)}, lprobs {tuple(lprobs.shape)}")
        rows, banned = banned_tokens(tokens[:, : step + 1], self.no_repeat_ngram_size)
        if rows.numel():
            lprobs[rows, banned] = float("-inf")
        return lprobs
