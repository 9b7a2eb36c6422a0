"""Data: the registered datasets (datasets.py), their split over clients (partition.py), and a device's own data
(own_data.py; data_files.py checks what files declare before decoding them)."""
