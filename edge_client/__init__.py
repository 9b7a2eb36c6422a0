"""The edge device agent: holds a client's model and data, and executes the server's tasks. The methods' own task
handlers (their client halves) are registered through fedge.plugins when the agent first looks one up."""

from edge_client import (
    distill,  # noqa: F401  (registers kd_train)
    tasks,  # noqa: F401  (registers the task handlers)
)
