"""Patch of fairseq's incremental-state lookup, so that compiled decoder layers share graphs.

fairseq's decoder layer asks its attention for the incremental (step-by-step decoding) state on
every call, training included, where there is none. ``get_incremental_state`` builds the state's
key from the module's ``_incremental_state_id``, a random string of each attention module,
before it looks at the state. ``torch.compile`` sees that string read and guards the compiled
graph on its value, so ``--compile-layers`` compiled each decoder layer's forward anew (the
recompile log names ``_incremental_state_id``): six decoder layers, times the variants of their
masks, past torch's recompile limit, and a call checked the guards of every graph before
finding its own.

The replacement returns None for a missing state before it builds the key, as fairseq's
version ends up returning; with a state it is fairseq's own.
"""

from __future__ import annotations

from .registry import Patch
from .registry import original as _original

GET = "fairseq.incremental_decoding_utils:FairseqIncrementalState.get_incremental_state"


def _get_incremental_state(self, incremental_state, key):
    if incremental_state is None:
        return None
    return _original(GET)(self, incremental_state, key)


PATCHES = [
    Patch(GET, group="precision", replacement=_get_incremental_state,
          expects=["full_key = self._get_full_incremental_state_key(key)",
                   "if incremental_state is None or full_key not in incremental_state:"],
          why="fairseq builds the state's key from a random per-module string before it sees that "
              "there is no state, which torch.compile guards on, so every decoder layer compiled "
              "its own graphs; without a state the lookup returns None at once"),
]
