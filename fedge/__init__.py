"""fedge shared core: the model representation (model/), the wire format (wire/), brokers and access (brokers/),
data and partitions (data/), and the run's config, constants, checkpoints, task configs and method plugins."""
