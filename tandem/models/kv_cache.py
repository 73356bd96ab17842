"""Preallocated KV cache with one slot per running sequence.

Layout (per K and V): ``[num_layers, num_slots, num_kv_heads, capacity + KV_SLACK, head_dim]``. The
positions past ``capacity`` never hold a sequence's tokens: padded tokens of a ragged batch write to
the last one (the scratch row), and the fused attention (``tandem.models.kernels``), which attends
``start + Q`` positions of every row whatever its real token count, may read them for a row's
padding only. Each slot has a length (tokens held); appending writes at
``length .. length + q - 1`` and truncating just lowers the length (O(1)), which is how
speculative decoding rolls back rejected draft tokens.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

import numpy as np
import torch

from ..errors import ConfigError
from .config import ModelConfig
from .transfer import to_device


def padded_rows(rows: list[list[int]], width: int, extra: int = 0) -> torch.Tensor:
    """``[len(rows), extra + width]`` int64 host tensor: ``extra`` zero columns, then each row's
    ints, zero-padded to ``width`` (longer rows raise ``ValueError``). Built in numpy: a nested list
    through ``torch.tensor`` is several times slower (a prefill's prompts, at every admission)."""
    out = np.zeros((len(rows), extra + width), dtype=np.int64)
    for i, row in enumerate(rows):
        if len(row) > width:
            raise ValueError(f"a row of {len(row)} ints in {width} columns")
        out[i, extra:extra + len(row)] = row
    return torch.from_numpy(out)


class CacheFullError(RuntimeError):
    """A slot would grow past the cache capacity, or no slot is free."""


KV_SLACK = 16  # positions past the capacity: the scratch row, and room for the widest fused step's padding


class SlotPool:
    """The free slots among ``0 .. num_slots - 1``, handed out lowest first (which keeps a running
    batch dense at low slot indices). One pool type for every slot numbering: a KV cache's, the
    verifier's slots as a remote client sees them, a drafter service's sequences.

    Args:
        num_slots: pool size (>= 0).
        what: what a slot is, for errors ("no free {what}").
    """

    def __init__(self, num_slots: int, what: str = "slot") -> None:
        self.num_slots = num_slots
        self.what = what
        self._free = list(range(num_slots))  # a min-heap

    def num_free(self) -> int:
        return len(self._free)

    def is_free(self, slot: int) -> bool:
        return slot in self._free

    def allocate(self) -> int:
        """Take the lowest free slot.

        Raises:
            CacheFullError: every slot is in use.
        """
        if not self._free:
            raise CacheFullError(f"no free {self.what}")
        return heapq.heappop(self._free)

    def claim(self, slot: int) -> None:
        """Take a specific free slot (a drafter mirrors the target's slot numbering).

        Raises:
            CacheFullError: the slot is in use or out of range.
        """
        if slot not in self._free:
            raise CacheFullError(f"{self.what} {slot} is not free")
        self._free.remove(slot)
        heapq.heapify(self._free)

    def free(self, slot: int) -> None:
        """Return a slot to the pool.

        Raises:
            ValueError: the slot is already free.
        """
        if slot in self._free:
            raise ValueError(f"{self.what} {slot} is already free")
        heapq.heappush(self._free, slot)


MEMORY_HEADROOM = 0.9  # share of the free memory one allocation may take


def free_memory_bytes(device: torch.device) -> int:
    """Free memory on ``device`` in bytes: ``torch.cuda.mem_get_info`` on CUDA, the operating
    system's available memory (psutil) elsewhere."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available


def check_fits(nbytes: int, device: torch.device, what: str) -> None:
    """Refuse an allocation that cannot fit before trying it (a CPU process would be OOM-killed,
    not get an exception).

    Raises:
        ConfigError: ``nbytes`` exceeds ``MEMORY_HEADROOM`` of the free memory on ``device``.
    """
    free = free_memory_bytes(device)
    if nbytes > MEMORY_HEADROOM * free:
        raise ConfigError(f"{what} needs {nbytes / 2**30:.1f} GiB but {free / 2**30:.1f} GiB is free on "
                          f"{device}: lower the context limit (--max-seq-len) or the batch size (KV cache slots)")


class KVCache:
    """Static per-slot KV cache.

    Args:
        config: model shape (layers, KV heads, head_dim).
        num_slots: sequences that can run at once (the maximum batch size).
        capacity: tokens per slot (prompt + generated), the context limit.
        device, dtype: where and how K/V are stored.

    Attributes:
        k, v: ``[num_layers, num_slots, num_kv_heads, capacity + KV_SLACK, head_dim]``.
        lengths: host-side list of tokens held per slot; the device copy is built per forward.
    """

    def __init__(self, config: ModelConfig, num_slots: int, capacity: int,
                 device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> None:
        if num_slots < 1 or capacity < 2:
            raise ValueError(f"need num_slots >= 1 and capacity >= 2, got {num_slots}, {capacity}")
        shape = (config.num_layers, num_slots, config.num_kv_heads, capacity + KV_SLACK, config.head_dim)
        check_fits(2 * math.prod(shape) * torch.empty((), dtype=dtype).element_size(), torch.device(device),
                   f"a KV cache of {num_slots} slots x {capacity} tokens")
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.num_slots = num_slots
        self.capacity = capacity
        self.lengths = [0] * num_slots
        self.slots = SlotPool(num_slots, "KV cache slot")

    @property
    def scratch_index(self) -> int:
        """Position index that padded tokens write to; never attended by a real token."""
        return self.k.shape[3] - 1

    def batch_rows(self, slots: list[int], positions: int) -> tuple[torch.Tensor, torch.Tensor, Callable[[], None]]:
        """K/V of ``slots`` (ascending) as the rows of one batch, ``[num_layers, len(slots),
        num_kv_heads, P, head_dim]`` each, and a function to call once the batch has written them.

        Contiguous slots: views of their rows (P = the full row; the function does nothing).
        Scattered slots (those requests freed, as admission finds them): a dense copy of their
        first ``positions`` positions plus one scratch position after them (P = positions + 1;
        padded tokens write there), which the function copies back. A batch over scattered slots
        then has one row per slot instead of a contiguous range whose idle rows cost as much.
        """
        lo, hi = slots[0], slots[-1]
        if hi - lo + 1 == len(slots):
            return self.k[:, lo:hi + 1], self.v[:, lo:hi + 1], lambda: None
        positions = min(positions, self.scratch_index)  # at most the whole row (whose last is scratch)
        index = to_device(torch.tensor(slots), self.k.device)
        rows = []
        for full in (self.k, self.v):
            part = full.new_empty(full.shape[:1] + (len(slots),) + full.shape[2:3] + (positions + 1,) + full.shape[4:])
            part[:, :, :, :positions] = full[:, index, :, :positions]
            rows.append(part)

        def write_back() -> None:
            self.k[:, index, :, :positions] = rows[0][:, :, :, :positions]
            self.v[:, index, :, :positions] = rows[1][:, :, :, :positions]
        return rows[0], rows[1], write_back

    def nbytes(self) -> int:
        """Bytes held by K and V together."""
        return self.k.numel() * self.k.element_size() * 2

    def num_free(self) -> int:
        return self.slots.num_free()

    def allocate(self) -> int:
        """Take the lowest free slot, empty (``SlotPool.allocate``; raises CacheFullError)."""
        slot = self.slots.allocate()
        self.lengths[slot] = 0
        return slot

    def claim(self, slot: int) -> None:
        """Take a specific free slot, empty (``SlotPool.claim``; raises CacheFullError)."""
        self.slots.claim(slot)
        self.lengths[slot] = 0

    def is_free(self, slot: int) -> bool:
        return self.slots.is_free(slot)

    def free(self, slot: int) -> None:
        """Return a slot to the pool (its contents become garbage; raises ValueError if already free)."""
        self.slots.free(slot)
        self.lengths[slot] = 0

    def truncate(self, slot: int, length: int) -> None:
        """Roll slot back to ``length`` tokens, O(1): later appends overwrite the dropped entries.

        Raises:
            ValueError: ``length`` is negative or longer than what the slot holds.
        """
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot truncate slot {slot} holding {self.lengths[slot]} tokens to {length}")
        self.lengths[slot] = length

    def move(self, slot: int, src: list[int], dst: list[int]) -> None:
        """Copy K/V of positions ``src`` to ``dst`` in every layer of ``slot`` (token-tree
        verification walked on the host: the accepted branch moves to consecutive positions)."""
        if src:
            self.move_rows(torch.tensor([[slot]], device=self.k.device), torch.tensor([src], device=self.k.device),
                           torch.tensor([dst], device=self.k.device))

    def move_rows(self, slots: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
        """``move`` for many slots at once, on the device (no host sync): in every layer, slot
        ``slots[i, 0]``'s K/V at positions ``src[i]`` is copied to ``dst[i]`` (``[n, 1]`` and
        ``[n, m]`` int64; a position copied onto itself is a no-op: the rows' unused entries)."""
        self.k[:, slots, :, dst] = self.k[:, slots, :, src]
        self.v[:, slots, :, dst] = self.v[:, slots, :, src]

    def check_room(self, slot: int, num_new: int) -> None:
        """Raise CacheFullError when ``num_new`` more tokens do not fit in ``slot``."""
        if self.lengths[slot] + num_new > self.capacity:
            raise CacheFullError(
                f"slot {slot} holds {self.lengths[slot]} tokens; {num_new} more exceed the capacity {self.capacity}"
            )
