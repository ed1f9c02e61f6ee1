"""What a record's payload means (EDGES_AND_WORKERS.md §1), both ways, for every
controller: a stage's input (u32 token ids, or activations ``(rows, hidden_dim)`` in the
edge's dtype) from a payload, a step's output (activations, or a last stage's token id
and the raw logits when its run asks) as a payload, and the orchestrator's token
objects (the ids it injects, the token and logits it reads)."""

from __future__ import annotations

import struct
from typing import Any

import numpy as np
import numpy.typing as npt

from runplan.messages import ProvisionStage
from runplan.plan import Layout, ObjectSpec
from runplan.record_header import HeaderDType
from runtime_core.activations import edge_dtype
from runtime_core.workers.interface import TokenOutput

# Enum members read on every record, bound once: on Python 3.11 ``Enum.MEMBER`` goes
# through the slow attribute hook of ``EnumType.__getattr__``.
_ROW_MAJOR = Layout.ROW_MAJOR
_WITH_LOGITS = Layout.TOKEN_ID_WITH_LOGITS
_HEADER_U32 = HeaderDType.U32
_U32 = struct.Struct("<I")
_U32_MAX = 2**32 - 1


def decode_input(spec: ObjectSpec, rows: int, payload: Any) -> npt.NDArray[np.generic]:
    """A stage's input from a record of ``spec`` (an owned array): activations
    ``(rows, hidden_dim)`` in the edge's dtype, or u32 token ids ``(rows,)``."""
    if spec.layout is _ROW_MAJOR:
        dtype = edge_dtype(spec.dtype_family, spec.dtype_width_bytes)
        return np.frombuffer(payload, dtype=dtype).reshape(rows, -1).copy()
    return np.frombuffer(payload, dtype="<u4").astype(np.uint32)


def encode_output(provision: ProvisionStage, output: Any) -> tuple[int, HeaderDType, bytes]:
    """``(rows, dtype, payload)`` of a step's output on the stage's outbound edge;
    ``ValueError`` for an output the edge does not carry."""
    spec = provision.outbound.object_spec
    if isinstance(output, TokenOutput):
        token_id = output.token_id
        if type(token_id) is int and 0 <= token_id <= _U32_MAX:
            payload = _U32.pack(token_id)  # the bytes NumPy would give, without an array
        else:
            payload = np.array([token_id], dtype="<u4").tobytes()
        if spec.layout is _WITH_LOGITS:
            if output.logits is None:
                raise ValueError("the run asks for logits; the worker gave none")
            payload += np.ascontiguousarray(output.logits, dtype="<f4").tobytes()
        return 1, _HEADER_U32, payload
    if spec.layout is not _ROW_MAJOR:
        raise ValueError(f"the last stage must return a TokenOutput, not {type(output)}")
    array = np.ascontiguousarray(output)
    dtype = HeaderDType.of(spec.dtype_family, spec.dtype_width_bytes)
    if array.dtype != edge_dtype(spec.dtype_family, spec.dtype_width_bytes):
        raise ValueError(f"activations of dtype {array.dtype}, the edge carries {dtype.name}")
    if array.ndim != 2 or array.shape[1] != provision.model.hidden_dim:
        raise ValueError(
            f"activations of shape {array.shape}, expected (rows, {provision.model.hidden_dim})"
        )
    return array.shape[0], dtype, array.tobytes()


def token_payload(ids: tuple[int, ...] | list[int]) -> bytes:
    """The payload of a token object of ``ids``."""
    if len(ids) == 1 and type(ids[0]) is int and 0 <= ids[0] <= _U32_MAX:
        return _U32.pack(ids[0])  # a fed-back token: NumPy's bytes, without an array
    return np.asarray(ids, dtype="<u4").tobytes()


def read_token(spec: ObjectSpec, payload: Any) -> tuple[int, npt.NDArray[np.float32] | None]:
    """The token id of a checked token-out record, and its logits when it carries them."""
    (token,) = _U32.unpack_from(payload)
    if spec.layout is _WITH_LOGITS:
        return token, np.frombuffer(payload[4:], dtype="<f4").copy()
    return token, None
