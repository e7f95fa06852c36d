"""The codec between the Tinker wire format (SDK 0.38 protobuf, SDK 0.16 JSON) and Twinkle's compute types.

Used by the API process, so it imports numpy, protobuf and zstandard only: never torch, never the SDK.
Malformed client input raises `twinkle.errors.InvalidRequest` (or `PayloadTooLarge`) naming the datum
and key at fault; a result that cannot be encoded raises ValueError, since that is a server bug.
"""

from api.tinker_codec.forward_backward_output import encode_forward_backward_output
from api.tinker_codec.forward_backward_request import ForwardBackwardRequestMeta, decode_forward_backward
from api.tinker_codec.hyperparameters import adam_params_from_json, sampling_params_from_json
from api.tinker_codec.json_output import forward_output_json, sample_output_json
from api.tinker_codec.model_input import decode_model_input
from api.tinker_codec.sample_output import encode_sample_output

__all__ = [
    "ForwardBackwardRequestMeta",
    "adam_params_from_json",
    "decode_forward_backward",
    "decode_model_input",
    "encode_forward_backward_output",
    "encode_sample_output",
    "forward_output_json",
    "sample_output_json",
    "sampling_params_from_json",
]
