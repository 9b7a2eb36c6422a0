"""The one model representation: ModelSpec (blocks of registered layers, spec.py, layers.py), weights as safetensors
(weights.py), the model zoo (zoo.py) and FedMN's modular network layer (modular.py)."""
