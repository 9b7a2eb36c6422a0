"""What travels: tasks and results (messages.py), what a reply may carry (payloads.py), the envelope, codec and
chunking of the wire format (envelope.py, codec.py, chunks.py, tensorblob.py) and the MQTT topic names (topics.py)."""
