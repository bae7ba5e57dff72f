"""hybrid_iter: iterative dataflow (the Flink ML iteration model) on Spark + Ray.

Spark is the data plane (one barrier stage; each task reads its data once), a Ray actor
is the coordinator and parameter server. See docs/design.md.

    import hybrid_iter as hi

    with hi.Session.local(parallelism=2) as session:
        result = hi.iterate_bounded_streams_until_termination(
            init_variables={"w": np.zeros(d)},
            data_streams=hi.ReplayableDataStreamList.not_replay(df),
            config=hi.IterationConfig(staleness=0, max_epochs=100),
            body=hi.IterationBody(partition=MyTrain(), coordinator=MyParams()),
        )
"""

from coordinator import (
    CoordinatorCollector,
    CoordinatorContext,
    OutputRecord,
    PartitionCollector,
    PartitionContext,
    TerminationReason,
)
from spark_ops import NumpyCache

from . import ml, ps
from ._body import (
    CoordinatorListener,
    ForwardInputsOfLastRound,
    IterationBody,
    TerminateOnMaxIter,
    TerminateOnMaxIterOrTol,
    TerminationCriteria,
)
from ._bulk_delta import BulkStep, DeltaStep, iterate_bulk, iterate_delta
from ._config import CheckpointConfig, EndpointConfig, IterationConfig, OperatorLifecycle
from ._errors import (
    CheckpointEncodeError,
    CheckpointError,
    ClassArchiveWarning,
    ConfigTypeError,
    DataValidationError,
    EndpointAuthError,
    EndpointBindError,
    EndpointError,
    EndpointVersionMismatch,
    HybridIterError,
    IterationConfigError,
    IterationFailedError,
    ModelExistsError,
    ModelNotFoundError,
    OnlineCheckpointError,
    RemoteFailure,
    SavedModelError,
    SessionError,
    SessionStoppedError,
    SparkOpsError,
    StoredArraysLost,
    UnverifiedModelWarning,
    UsageError,
    UserFunctionError,
    ValueEncodeError,
    VariablesMismatchError,
    WorkerDiedError,
)
from ._operators import CoordinatorOperator, IterationListener, PartitionOperator
from ._result import IterationResult
from ._runtime.iterate import iterate_bounded_streams_until_termination
from ._runtime.online import (
    EPOCH_MAX,
    OnlineConfig,
    OnlineIteration,
    OnlineProgress,
    iterate_unbounded_streams,
)
from ._session import Session
from ._streams import DataStream, ReplayableDataStreamList

__version__ = "0.1.0"

__all__ = [
    "EPOCH_MAX",
    "BulkStep",
    "CheckpointConfig",
    "CheckpointEncodeError",
    "CheckpointError",
    "ClassArchiveWarning",
    "ConfigTypeError",
    "CoordinatorCollector",
    "CoordinatorContext",
    "CoordinatorListener",
    "CoordinatorOperator",
    "DataStream",
    "DataValidationError",
    "DeltaStep",
    "EndpointAuthError",
    "EndpointBindError",
    "EndpointConfig",
    "EndpointError",
    "EndpointVersionMismatch",
    "ForwardInputsOfLastRound",
    "HybridIterError",
    "IterationBody",
    "IterationConfig",
    "IterationConfigError",
    "IterationFailedError",
    "IterationListener",
    "IterationResult",
    "ModelExistsError",
    "ModelNotFoundError",
    "NumpyCache",
    "OnlineCheckpointError",
    "OnlineConfig",
    "OnlineIteration",
    "OnlineProgress",
    "OperatorLifecycle",
    "OutputRecord",
    "PartitionCollector",
    "PartitionContext",
    "PartitionOperator",
    "RemoteFailure",
    "ReplayableDataStreamList",
    "SavedModelError",
    "Session",
    "SessionError",
    "SessionStoppedError",
    "SparkOpsError",
    "StoredArraysLost",
    "TerminateOnMaxIter",
    "TerminateOnMaxIterOrTol",
    "TerminationCriteria",
    "TerminationReason",
    "UnverifiedModelWarning",
    "UsageError",
    "UserFunctionError",
    "ValueEncodeError",
    "VariablesMismatchError",
    "WorkerDiedError",
    "__version__",
    "iterate_bounded_streams_until_termination",
    "iterate_bulk",
    "iterate_delta",
    "iterate_unbounded_streams",
    "ml",
    "ps",
]
