"""twinkle_client: train and sample on a Twinkle server with the same code as local twinkle training.

    from twinkle_client import init_twinkle_client
    from twinkle_client.model import MultiLoraTransformersModel

    client = init_twinkle_client(base_url='http://127.0.0.1:8000', api_key='your-api-key')
    model = MultiLoraTransformersModel(model_id='ms://Qwen/Qwen3.5-4B')

Importing this package is light (httpx, pydantic, numpy, tqdm); the model, sampler, dataset and
dataloader modules are imported on use, and only the dataset module needs the local data library.
"""

from twinkle_client.client import TwinkleClient, current_client, init_twinkle_client
from twinkle_client.errors import (
    APIError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    ConnectionFailed,
    FutureTimeout,
    GoneError,
    InternalServerError,
    InvalidArgument,
    NotFoundError,
    PayloadTooLargeError,
    QuotaExceededError,
    RateLimitError,
    RequestFailed,
    TwinkleClientError,
)
from twinkle_client.futures import TwinkleFuture
from twinkle_client.transport import RetryPolicy
from twinkle_client.types import (
    CapacityInfo,
    Checkpoint,
    ForwardBackwardResult,
    ForwardOnlyResult,
    HubUpload,
    ImportedAdapter,
    MergedExport,
    MergedUrls,
    MetricResult,
    SampledSequence,
    SampleResult,
    ServerCapabilities,
    StepResult,
    SupportedModel,
    TrainConfig,
    TrainingRun,
    WeightsInfo,
)

__all__ = [
    "APIError",
    "AuthenticationError",
    "BadRequestError",
    "CapacityInfo",
    "Checkpoint",
    "ConflictError",
    "ConnectionFailed",
    "ForwardBackwardResult",
    "ForwardOnlyResult",
    "FutureTimeout",
    "GoneError",
    "HubUpload",
    "ImportedAdapter",
    "InternalServerError",
    "InvalidArgument",
    "MergedExport",
    "MergedUrls",
    "MetricResult",
    "NotFoundError",
    "PayloadTooLargeError",
    "QuotaExceededError",
    "RateLimitError",
    "RequestFailed",
    "RetryPolicy",
    "SampleResult",
    "SampledSequence",
    "ServerCapabilities",
    "StepResult",
    "SupportedModel",
    "TrainConfig",
    "TrainingRun",
    "TwinkleClient",
    "TwinkleClientError",
    "TwinkleFuture",
    "WeightsInfo",
    "current_client",
    "init_twinkle_client",
]
