"""The Tinker SDK's protobuf messages as artrl's: a ForwardBackwardRequest's datums as `TokenDatum`s, and
a call's per-datum logprobs and metrics as a ForwardBackwardOutput (the SDK reads those as protobuf only).
The messages are the `tinker` package's own (`tinker.proto.tinker_public_pb2`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from artrl.local.train.tinker.steps import TokenDatum

_NUMPY = {1: np.float32, 2: np.int64, 3: np.int32}  # DType: FLOAT32, INT64, INT32


def messages() -> Any:
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError:
        raise RuntimeError(
            "the Tinker API needs the `tinker` package on the server (its protobuf messages): pip install tinker"
        ) from None
    return tinker_public_pb2


@dataclass
class ForwardBackward:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float]
    forward_only: bool
    data: list[TokenDatum]


def read_forward_backward(body: bytes) -> ForwardBackward:
    """ValueError for what artrl does not train (an image chunk, sparse tensors, text settings)."""
    pb = messages()
    request = pb.ForwardBackwardRequest()
    try:
        request.ParseFromString(body)
    except Exception as exc:  # (protobuf's DecodeError)
        raise ValueError(f"the body is not a ForwardBackwardRequest: {exc}") from None
    config: dict[str, float] = dict(request.loss_fn_config)
    for key, value in request.loss_fn_config_v2.items():
        if value.WhichOneof("value") != "number":
            raise ValueError(f"loss_fn_config[{key!r}] must be a number")
        config[key] = value.number
    data = []
    for i, datum in enumerate(request.data):
        tokens: list[int] = []
        for chunk in datum.model_input:
            if chunk.WhichOneof("chunk") != "encoded_text":
                raise ValueError(
                    f"datum {i}: only token chunks are trained here (got {chunk.WhichOneof('chunk')})"
                )
            tokens += np.frombuffer(chunk.encoded_text.tokens, np.int32).tolist()
        inputs = {}
        for key, tensor in datum.loss_fn_inputs.items():
            if tensor.WhichOneof("encoding") != "dense" or tensor.dtype not in _NUMPY:
                raise ValueError(f"datum {i}: loss_fn_inputs[{key!r}] must be a dense float32 or int tensor")
            values = np.frombuffer(tensor.dense, _NUMPY[tensor.dtype])
            if len(tensor.shape) > 1:
                raise ValueError(
                    f"datum {i}: loss_fn_inputs[{key!r}] must be one value per token (got {list(tensor.shape)})"
                )
            inputs[key] = values.tolist()
        data.append(TokenDatum(tokens, inputs))
    return ForwardBackward(
        request.model_id, request.seq_id, request.loss_fn, config, request.forward_only, data
    )


def forward_backward_output(logprobs: list[list[float]], metrics: dict[str, float]) -> bytes:
    pb = messages()
    out = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for key, value in metrics.items():
        out.metrics[key] = value
    record = out.loss_fn_outputs.add()
    record.num_datums = len(logprobs)
    field = record.fields["logprobs"]
    field.dtype = pb.DTYPE_FLOAT32
    arrays = [np.asarray(values, np.float32) for values in logprobs]
    field.data = b"".join(a.tobytes() for a in arrays)
    field.offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64).tobytes()
    return out.SerializeToString()
