"""Ray side of hybrid_iter: the pure coordinator core (``CoordinatorCore``: the epoch
state machine and the cut behind one ``handle(event) -> instructions``), the actor that
wraps it (a plain class, made an actor where it is launched), both tiers' ``ctx``/``out``
(``_operator_api``), the seam between a subtask and its coordinator (``_link``), and the
versioned variables store of the parameter server.

Never imports pyspark or hybrid_iter.
"""

from ._actor import IterationCoordinator
from ._checkpoint import (
    CheckpointStore,
    LoadedCheckpoint,
    checkpoint_key,
    previous_checkpoint_key,
)
from ._core import CoordinatorCore
from ._errors import (
    CallTimeout,
    CheckpointCorrupt,
    CheckpointDamaged,
    CheckpointEncodeError,
    CheckpointError,
    ConfigTypeError,
    CoreError,
    CutError,
    EndpointAuthError,
    EndpointBindError,
    EndpointError,
    EndpointVersionMismatch,
    FeedbackShapeMismatch,
    ForeignCheckpoint,
    HybridIterError,
    IterationConfigError,
    MissingCheckpoint,
    NonFiniteVariables,
    RemoteFailure,
    SavedModelError,
    SpareMisuse,
    StateMachineError,
    UnpicklableOperator,
    UsageError,
    ValueEncodeError,
    VariablesMismatchError,
)
from ._hooks import RuntimeHooks
from ._identity import (
    RestoredCheckpoint,
    damaged_since,
    fingerprint_mismatch,
    iteration_fingerprint,
    node_local_refusal,
)
from ._link import CoordinatorLink, InProcessLink, Pending, RayLink
from ._online import OnlineCoordinator
from ._online_protocol import (
    BadFile,
    OnlineCommit,
    OnlineRestore,
    OnlineStatus,
    PartitionTally,
)
from ._operator_api import (
    CoordinatorCollector,
    CoordinatorContext,
    PartitionCollector,
    PartitionContext,
)
from ._protocol import Emissions, OutputRecord, Progress, Reply, ResultData
from ._snapshots import CheckpointInfo
from ._spec import CheckpointSpec, CoordinatorSpec
from ._state import EpochCounts, EpochStateMachine, Release, TerminationReason
from ._variables import VariablesPayload, VariableSpec, VariablesStore, normalize_variables

__all__ = [
    "BadFile",
    "CallTimeout",
    "CheckpointCorrupt",
    "CheckpointDamaged",
    "CheckpointEncodeError",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointSpec",
    "CheckpointStore",
    "ConfigTypeError",
    "CoordinatorCollector",
    "CoordinatorContext",
    "CoordinatorCore",
    "CoordinatorLink",
    "CoordinatorSpec",
    "CoreError",
    "CutError",
    "Emissions",
    "EndpointAuthError",
    "EndpointBindError",
    "EndpointError",
    "EndpointVersionMismatch",
    "EpochCounts",
    "EpochStateMachine",
    "FeedbackShapeMismatch",
    "ForeignCheckpoint",
    "HybridIterError",
    "InProcessLink",
    "IterationConfigError",
    "IterationCoordinator",
    "LoadedCheckpoint",
    "MissingCheckpoint",
    "NonFiniteVariables",
    "OnlineCommit",
    "OnlineCoordinator",
    "OnlineRestore",
    "OnlineStatus",
    "OutputRecord",
    "PartitionCollector",
    "PartitionContext",
    "PartitionTally",
    "Pending",
    "Progress",
    "RayLink",
    "Release",
    "RemoteFailure",
    "Reply",
    "RestoredCheckpoint",
    "ResultData",
    "RuntimeHooks",
    "SavedModelError",
    "SpareMisuse",
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
    "iteration_fingerprint",
    "node_local_refusal",
    "normalize_variables",
    "previous_checkpoint_key",
]
