"""Every default, limit and factor of the device_profiles package, in one place."""

# Runtimes a device can train with: eager PyTorch (Raspberry Pi, Jetson, servers) or an
# ExecuTorch training program (Android; see DESIGN.md "Strategies").
ALLOWED_RUNTIMES: frozenset[str] = frozenset({"torch", "executorch"})

# Users add profile directories here, separated by os.pathsep (like PATH).
PROFILE_PATH_ENV = "FEDGE_PROFILE_PATH"

# A profile file is <name>.toml; the name must match this pattern (it ends up in logs and
# MQTT topics, so no spaces or path separators).
PROFILE_SUFFIX = ".toml"
PROFILE_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9_.-]*"

# FedScale's round-time model: training one sample costs about 3x its forward pass
# (backward ~ 2x forward); FedScale fedscale/cloud/internal/client_metadata.py,
# ecosystem-notes §1.3 [S2]. Applied once, in capability.train_seconds.
TRAIN_COST_FACTOR = 3

# Training-memory estimate: fp32 weights (4 bytes) held 4 times -- weights, gradients and
# Adam's two moments. Activations and runtime overhead are NOT included; the profiles'
# memory_bytes already subtract the OS and runtime (see each profile's comment).
BYTES_PER_PARAM = 4
TRAINING_COPIES = 4

# Full training footprint (capability.training_footprint_bytes): fp32 activations (4 bytes per element)
# and the optimiser state per parameter: Adam keeps two moments, SGD with momentum one, plain SGD none.
BYTES_PER_ACTIVATION = 4
OPTIMIZER_STATES: dict[str, int] = {"adam": 2, "sgd_momentum": 1, "sgd": 0}
# The optimiser each runtime trains with (edge_client.training: Adam; the executorch program: SGD + momentum).
RUNTIME_OPTIMIZER: dict[str, str] = {"torch": "adam", "executorch": "sgd_momentum"}

# Transfer directions accepted by capability.transfer_seconds.
DIRECTION_UP = "up"
DIRECTION_DOWN = "down"
