"""Ray side of hybrid_iter: the pure epoch/termination state machine, the coordinator
actor that wraps it (a plain class, made an actor where it is launched), and the
versioned variables store of the parameter server.

Never imports pyspark or hybrid_iter.
"""

from ._actor import (
    CheckpointInfo,
    CheckpointSpec,
    CoordinatorCollector,
    CoordinatorContext,
    CoordinatorSpec,
    FeedbackShapeMismatch,
    IterationCoordinator,
    MissingCheckpoint,
    NonFiniteVariables,
    UnpicklableOperator,
)
from ._checkpoint import (
    CheckpointCorrupt,
    CheckpointStore,
    ForeignCheckpoint,
    LoadedCheckpoint,
    checkpoint_key,
    damaged_since,
    fingerprint_mismatch,
    previous_checkpoint_key,
)
from ._cut import CutError
from ._errors import (
    CheckpointEncodeError,
    CheckpointError,
    ConfigTypeError,
    HybridIterError,
    IterationConfigError,
    RemoteFailure,
    UsageError,
    ValueEncodeError,
    VariablesMismatchError,
)
from ._hooks import RuntimeHooks
from ._online import OnlineCoordinator
from ._protocol import Emissions, OutputRecord, Progress, Reply, ResultData
from ._state import EpochCounts, EpochStateMachine, Release, StateMachineError, TerminationReason
from ._variables import VariablesPayload, VariableSpec, VariablesStore, normalize_variables

__all__ = [
    "CheckpointCorrupt",
    "CheckpointEncodeError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointSpec",
    "CheckpointStore",
    "ConfigTypeError",
    "CoordinatorCollector",
    "CoordinatorContext",
    "CoordinatorSpec",
    "CutError",
    "Emissions",
    "EpochCounts",
    "EpochStateMachine",
    "FeedbackShapeMismatch",
    "ForeignCheckpoint",
    "HybridIterError",
    "IterationConfigError",
    "IterationCoordinator",
    "LoadedCheckpoint",
    "MissingCheckpoint",
    "NonFiniteVariables",
    "OnlineCoordinator",
    "OutputRecord",
    "Progress",
    "Release",
    "RemoteFailure",
    "Reply",
    "ResultData",
    "RuntimeHooks",
    "StateMachineError",
    "TerminationReason",
    "UnpicklableOperator",
    "UsageError",
    "ValueEncodeError",
    "VariableSpec",
    "VariablesMismatchError",
    "VariablesPayload",
    "VariablesStore",
    "checkpoint_key",
    "damaged_since",
    "fingerprint_mismatch",
    "normalize_variables",
    "previous_checkpoint_key",
]
