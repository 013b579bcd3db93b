"""schemathesis hooks for bench/fuzz.py (loaded through SCHEMATHESIS_HOOKS): protobuf bodies go on
the wire as the bytes generated for them (``forward_backward`` takes ``application/x-protobuf``)."""

import schemathesis
from schemathesis.transport.serialization import serialize_binary


@schemathesis.serializer("application/x-protobuf")
def protobuf(ctx, value):
    return serialize_binary(value)
