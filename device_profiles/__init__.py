"""Device profiles: schema, bundled TOML profiles, capability checks; imports nothing of fedge."""

from device_profiles.capability import (
    Footprint,
    SizedModel,
    TrainableModel,
    Verdict,
    checked_count,
    compatible_models,
    fits,
    memory_fits,
    train_seconds,
    training_fits,
    training_footprint_bytes,
    training_memory_bytes,
    transfer_seconds,
    within_size_bound,
)
from device_profiles.profile import DeviceProfile, ProfileError, load_profile, profile_from_mapping
from device_profiles.registry import (
    BUNDLED_DIR,
    get_profile,
    list_profiles,
    profile_files,
    search_dirs,
    validate_profile_file,
)

__all__ = [
    "BUNDLED_DIR",
    "DeviceProfile",
    "Footprint",
    "ProfileError",
    "SizedModel",
    "TrainableModel",
    "Verdict",
    "checked_count",
    "compatible_models",
    "fits",
    "get_profile",
    "list_profiles",
    "load_profile",
    "memory_fits",
    "profile_files",
    "profile_from_mapping",
    "search_dirs",
    "train_seconds",
    "training_footprint_bytes",
    "training_fits",
    "training_memory_bytes",
    "transfer_seconds",
    "validate_profile_file",
    "within_size_bound",
]
