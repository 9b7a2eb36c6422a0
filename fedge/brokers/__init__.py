"""Brokers and access: the MQTT connection and inbox checks (mqtt.py, link.py), the transport interface
(transport.py), broker access rules (access.py), the embedded broker, and Mosquitto and RabbitMQ files."""
