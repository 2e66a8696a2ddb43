"""Naming a tensor without a weak reference to it.

``torch.utils.swap_tensors`` refuses a tensor that has a weak reference, Python's or
torch's own (and ``Module._apply`` swaps every parameter under
``torch.__future__.set_swap_module_params_on_conversion(True)``; so does
``load_state_dict`` there). What metamode keeps about a tensor it does not own names it by
its Python object, the address of its implementation and the address of its storage, the
last kept from reuse by torch's weak reference to the storage. A swap gives the Python
object another implementation and storage: it is another tensor to torch, and here.
"""

from __future__ import annotations

import torch

from metamode._torch import DisableTorchFunction, StorageRef

__all__ = ["Held", "Named"]


class Held:
    """A strong reference to a meta tensor, called like a weak one: it returns the tensor
    while it has the implementation and storage it had, else None. (A meta tensor holds
    no memory; a real one is held by ``weakref.ref``, which keeps nothing alive.)"""

    __slots__ = ("impl", "storage", "tensor")

    def __init__(self, tensor: torch.Tensor, storage: torch.UntypedStorage | None = None) -> None:
        # made and called where the recorder reads tensors anyway (inside its mode's
        # handler, or under DisableTorchFunction); ``storage``: the tensor's, if known
        self.tensor = tensor
        self.impl: int = tensor._cdata
        self.storage: int = (storage if storage is not None else tensor.untyped_storage())._cdata

    def __call__(self) -> torch.Tensor | None:
        tensor = self.tensor
        if tensor._cdata == self.impl and tensor.untyped_storage()._cdata == self.storage:
            return tensor
        return None


class Named:
    """A tensor named by ``id``, its implementation and its storage, holding nothing of it
    but its storage's address (torch's weak reference to the storage)."""

    __slots__ = ("impl", "keep", "storage")

    def __init__(
        self,
        tensor: torch.Tensor,
        storage: torch.UntypedStorage | None = None,
        keep: StorageRef | None = None,
    ) -> None:
        """``storage``, ``keep``: the tensor's storage and a weak reference to it, if the
        caller has them."""
        if storage is None:
            with DisableTorchFunction():  # metamode's own reads, not the build's
                storage = tensor.untyped_storage()
        self.impl: int = tensor._cdata
        self.storage: int = storage._cdata
        self.keep = keep if keep is not None else StorageRef(storage)

    def of(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (of the ``id`` this was kept under) is the tensor named."""
        with DisableTorchFunction():
            return (
                tensor.layout is torch.strided
                and tensor._cdata == self.impl
                and tensor.untyped_storage()._cdata == self.storage
                and not self.keep.expired()
            )

    def expired(self) -> bool:
        """Whether its storage is gone, and so the tensor."""
        return self.keep.expired()
