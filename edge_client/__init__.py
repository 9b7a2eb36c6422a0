"""The edge device agent: holds a client's model and data, and executes the server's tasks."""

from edge_client import (
    dcpfl,  # noqa: F401  (registers dc_train)
    distill,  # noqa: F401  (registers kd_train)
    fedmn,  # noqa: F401  (registers modular_train, modular_evaluate)
    tasks,  # noqa: F401  (registers the task handlers)
)
