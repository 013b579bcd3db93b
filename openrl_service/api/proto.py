"""The Tinker protobuf wire format (package ``tinker_public``), built from a schema at import time.

Only field numbers and types matter on the wire; the schema below mirrors the SDK's published
messages, so the service needs neither protoc nor the SDK. Packed ``bytes`` are little-endian,
C-order arrays.
"""

from __future__ import annotations

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

F = descriptor_pb2.FieldDescriptorProto
_T = {
    "string": F.TYPE_STRING,
    "bytes": F.TYPE_BYTES,
    "int32": F.TYPE_INT32,
    "int64": F.TYPE_INT64,
    "uint32": F.TYPE_UINT32,
    "bool": F.TYPE_BOOL,
    "double": F.TYPE_DOUBLE,
    "float": F.TYPE_FLOAT,
}
ENUMS = {
    "StopReason": [("STOP_REASON_STOP", 0), ("STOP_REASON_LENGTH", 1)],
    "DType": [
        ("DTYPE_UNSPECIFIED", 0),
        ("DTYPE_FLOAT32", 1),
        ("DTYPE_INT64", 2),
        ("DTYPE_INT32", 3),
        ("DTYPE_BFLOAT16", 4),
    ],
}
# message -> [(name, number, type, label, oneof)]; label "r" repeated, "o" proto3 optional, "" singular;
# "map:K,V" types become map entries.
SCHEMA: dict[str, list[tuple]] = {
    "ForwardBackwardRequest": [
        ("model_id", 1, "string", "", None),
        ("seq_id", 2, "int32", "", None),
        ("data", 3, "Datum", "r", None),
        ("loss_fn", 4, "string", "", None),
        ("loss_fn_config", 5, "map:string,double", "", None),
        ("forward_only", 6, "bool", "", None),
        ("loss_fn_config_v2", 7, "map:string,LossConfigValue", "", None),
    ],
    "LossConfigValue": [("number", 1, "double", "", "value"), ("text", 2, "string", "", "value")],
    "Datum": [
        ("model_input", 1, "Chunk", "r", None),
        ("loss_fn_inputs", 2, "map:string,Tensor", "", None),
        ("model_input_spans", 3, "ProvenanceSpan", "r", None),
        ("loss_fn_input_spans", 4, "ProvenanceSpan", "r", None),
    ],
    "Chunk": [
        ("encoded_text", 1, "EncodedTextChunk", "", "chunk"),
        ("image", 2, "ImageChunk", "", "chunk"),
        ("dmel", 3, "DmelChunk", "", "chunk"),
    ],
    "EncodedTextChunk": [("tokens", 1, "bytes", "", None)],
    "ImageChunk": [
        ("data", 1, "bytes", "", None),
        ("format", 2, "string", "", None),
        ("expected_tokens", 3, "int32", "o", None),
        ("override_dimensions", 4, "ImageDimensions", "o", None),
    ],
    "ImageDimensions": [("width", 1, "uint32", "", None), ("height", 2, "uint32", "", None)],
    "DmelChunk": [("dmel", 1, "bytes", "", None)],
    "Tensor": [
        ("dense", 1, "bytes", "", "encoding"),
        ("sparse_csr", 2, "SparseCsr", "", "encoding"),
        ("dtype", 3, "DType", "", None),
        ("shape", 4, "int64", "r", None),
    ],
    "SparseCsr": [
        ("values", 1, "bytes", "", None),
        ("crow_indices", 2, "bytes", "", None),
        ("col_indices", 3, "bytes", "", None),
    ],
    "ProvenanceSpan": [
        ("prompt_tokens", 1, "PromptProvenanceSpan", "", "span"),
        ("sampled_tokens", 2, "SampledProvenanceSpan", "", "span"),
    ],
    "PromptProvenanceSpan": [
        ("sequence_id", 1, "string", "", None),
        ("offset", 2, "int64", "", None),
        ("length", 3, "int64", "", None),
    ],
    "SampledProvenanceSpan": [
        ("sequence_id", 1, "string", "", None),
        ("offset", 2, "int64", "", None),
        ("length", 3, "int64", "", None),
    ],
    "ForwardBackwardOutput": [
        ("loss_fn_output_type", 1, "string", "", None),
        ("loss_fn_outputs", 2, "ArrayRecord", "r", None),
        ("metrics", 3, "map:string,double", "", None),
    ],
    "ArrayRecord": [
        ("type_tag", 1, "string", "", None),
        ("fields", 2, "map:string,BatchedTensor", "", None),
        ("num_datums", 3, "int64", "", None),
    ],
    "BatchedTensor": [
        ("data", 1, "bytes", "", None),
        ("offsets", 2, "bytes", "", None),
        ("dtype", 3, "DType", "", None),
        ("trailing_shape", 4, "int64", "r", None),
    ],
    "SampleResponse": [
        ("sequences", 1, "SampledSequence", "r", None),
        ("prompt_logprobs", 2, "bytes", "o", None),
        ("topk_prompt_logprobs", 3, "TopkLogprobs", "o", None),
        ("prompt_cache_hit_tokens", 4, "int32", "", None),
        ("target_prompt_logprobs", 5, "Tensor", "o", None),
        ("prompt_alt_tokens", 6, "PromptAltTokens", "o", None),
    ],
    "PromptAltTokens": [("tokens", 1, "Tensor", "", None), ("logprobs", 2, "Tensor", "", None)],
    "SampledSequence": [
        ("stop_reason", 1, "StopReason", "", None),
        ("tokens", 2, "bytes", "", None),
        ("logprobs", 3, "bytes", "o", None),
        ("topk_sampled_logprobs", 4, "TopkLogprobs", "o", None),
    ],
    "TopkLogprobs": [
        ("token_ids", 1, "bytes", "", None),
        ("logprobs", 2, "bytes", "", None),
        ("k", 3, "uint32", "", None),
        ("length", 4, "uint32", "", None),
    ],
}


def _set_type(f, typ: str) -> None:
    if typ in _T:
        f.type = _T[typ]
    elif typ in ENUMS:
        f.type = F.TYPE_ENUM
        f.type_name = f".tinker_public.{typ}"
    else:
        f.type = F.TYPE_MESSAGE
        f.type_name = f".tinker_public.{typ}"


def _build():
    fd = descriptor_pb2.FileDescriptorProto(
        name="openrl_tinker_public.proto", package="tinker_public", syntax="proto3"
    )
    for name, values in ENUMS.items():
        e = fd.enum_type.add(name=name)
        for vname, num in values:
            e.value.add(name=vname, number=num)
    for mname, fields in SCHEMA.items():
        m = fd.message_type.add(name=mname)
        oneofs: dict[str, int] = {}
        for *_, oneof in fields:
            if oneof and oneof not in oneofs:
                oneofs[oneof] = len(m.oneof_decl)
                m.oneof_decl.add(name=oneof)
        for fname, num, typ, label, oneof in fields:
            f = m.field.add(name=fname, number=num)
            if typ.startswith("map:"):
                k, v = typ[4:].split(",")
                entry = m.nested_type.add(name="".join(p.capitalize() for p in fname.split("_")) + "Entry")
                entry.options.map_entry = True
                kf = entry.field.add(name="key", number=1, label=F.LABEL_OPTIONAL)
                _set_type(kf, k)
                vf = entry.field.add(name="value", number=2, label=F.LABEL_OPTIONAL)
                _set_type(vf, v)
                f.label = F.LABEL_REPEATED
                f.type = F.TYPE_MESSAGE
                f.type_name = f".tinker_public.{mname}.{entry.name}"
                continue
            _set_type(f, typ)
            f.label = F.LABEL_REPEATED if label == "r" else F.LABEL_OPTIONAL
            if oneof:
                f.oneof_index = oneofs[oneof]
        # proto3 `optional` fields are synthetic one-member oneofs, declared after the real ones.
        for f in m.field:
            spec = next(x for x in fields if x[0] == f.name)
            if spec[3] == "o":
                f.proto3_optional = True
                f.oneof_index = len(m.oneof_decl)
                m.oneof_decl.add(name=f"_{f.name}")
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"tinker_public.{name}"))
        for name in SCHEMA
    }


MESSAGES = _build()
ForwardBackwardRequest = MESSAGES["ForwardBackwardRequest"]
ForwardBackwardOutput = MESSAGES["ForwardBackwardOutput"]
SampleResponse = MESSAGES["SampleResponse"]

DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32, DTYPE_BFLOAT16 = 1, 2, 3, 4
NUMPY_OF = {DTYPE_FLOAT32: np.float32, DTYPE_INT64: np.int64, DTYPE_INT32: np.int32}
DTYPE_NAMES = {0: "unspecified", 1: "float32", 2: "int64", 3: "int32", 4: "bfloat16"}
STOP_REASON = {"stop": 0, "length": 1}
