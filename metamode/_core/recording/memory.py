"""Memory torch's version counters do not watch, and tensors kept for a later replay.

A storage torch did not allocate (``torch.from_numpy``, ``torch.asarray`` of a Python
buffer, ``torch.frombuffer``, DLPack) holds bytes its owner writes without moving any
version counter; torch states this by making such a storage not resizable. The recording
keeps a snapshot of every such storage it sees, compares it at each later read, and
records what changed as a write of those bytes (:func:`refill`), so replay reads what
eager construction read at that moment. A real tensor made outside the recording in
memory torch owns is held, not copied: its version counter shows whether it changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Bytes", "ExternalMemory", "Kept", "refill"]


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
        storage, 0, (storage.nbytes(),), (1,)
    )


class Bytes:
    """A storage's bytes at one moment, as a recorded call's argument."""

    __slots__ = ("value",)

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"<{self.value.numel()} bytes>"

    def storage(self) -> torch.UntypedStorage:
        """A private copy, for a replay to read (and write) freely."""
        return self.value.clone().untyped_storage()


def refill(target: torch.Tensor, data: Bytes) -> None:
    """Replays a change of memory torch does not watch: ``target`` (all of a storage, as
    bytes) gets ``data``."""
    target.copy_(data.value)


@dataclass(slots=True)
class _Watched:
    index: int  # the storage's index in the program
    storage: torch.UntypedStorage  # held while the recording runs, so the address stays its
    value: torch.Tensor  # its bytes when the recording last saw them


class ExternalMemory:
    """The storages of one recording whose memory torch does not own."""

    def __init__(self) -> None:
        self.watched: dict[int, _Watched] = {}  # storage address -> what was seen
        self._by_index: dict[int, _Watched] = {}
        # meta storage address -> (index, [(array or buffer, its bytes then)]): a factory
        # made it from memory eager construction's tensor would share
        self._aliased: dict[int, tuple[int, list[tuple[Any, bytes]]]] = {}
        self.active = False  # anything watched at all

    def alias(self, index: int, storage: torch.UntypedStorage, sources: list[Any]) -> None:
        """Meta storage ``index`` stands for a tensor eager construction makes over the
        memory of ``sources`` (NumPy arrays, Python buffers): note their bytes now."""
        held = [(source, found) for source in sources if (found := _contents(source)) is not None]
        if held:
            self._aliased[storage._cdata] = (index, held)
            self.active = True

    def aliased(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (meta) stands for one eager construction makes over the
        memory of a NumPy array or Python buffer."""
        return (
            bool(self._aliased)
            and tensor.layout is torch.strided
            and tensor.untyped_storage()._cdata in self._aliased
        )

    def diverged(self, tensors: list[torch.Tensor]) -> list[int]:
        """The meta storages among ``tensors``' whose source memory changed since they were
        made: eager's tensor, sharing it, would read other values now."""
        found = []
        for tensor in tensors:
            if tensor.layout is not torch.strided:
                continue  # no storage (sparse...): refused by its layout
            address = tensor.untyped_storage()._cdata
            held = self._aliased.get(address)
            if held is not None and any(_contents(s) != b for s, b in held[1]):
                del self._aliased[address]
                found.append(held[0])
        return found

    def watch(self, index: int, storage: torch.UntypedStorage) -> Bytes:
        """Start watching ``storage`` (program storage ``index``); its bytes now."""
        seen = _Watched(index, storage, _bytes(storage).clone())
        self.watched[storage._cdata] = self._by_index[index] = seen
        self.active = True
        return Bytes(seen.value)

    def changed(self, tensors: list[torch.Tensor]) -> list[tuple[int, Bytes]]:
        """(storage index, bytes now) for each watched storage among ``tensors``' whose bytes
        changed since the recording last saw them."""
        found = []
        for tensor in tensors:
            if tensor.layout is not torch.strided:
                continue  # no storage (sparse...): refused by its layout
            seen = self.watched.get(tensor.untyped_storage()._cdata)
            if seen is None:
                continue
            now = _bytes(seen.storage)
            if not torch.equal(now, seen.value):
                seen.value = now.clone()
                found.append((seen.index, Bytes(seen.value)))
        return found

    def owns(self, index: int) -> bool:
        """Whether storage ``index``'s memory is watched here (torch does not own it)."""
        return index in self._by_index

    def written(self, index: int) -> None:
        """A recorded call wrote storage ``index``: what it holds now is the call's doing."""
        seen = self._by_index.get(index)
        if seen is not None:
            seen.value = _bytes(seen.storage).clone()


def _contents(source: Any) -> bytes | None:
    """The bytes of a NumPy array or Python buffer now, or None if it has none."""
    try:
        return memoryview(source).tobytes()
    except (TypeError, ValueError, BufferError):
        return None


class Kept:
    """A real tensor from outside the recording, kept (a strong reference) until the build
    overwrites it, so replay can read its first value; called like a weak reference."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor | None) -> None:
        self.tensor = tensor

    def __call__(self) -> torch.Tensor | None:
        return self.tensor
