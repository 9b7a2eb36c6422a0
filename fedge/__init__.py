"""fedge shared core: model specs, layer registry, zoo, weights, data, partitions, config, transport."""
