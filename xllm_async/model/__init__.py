"""Model code of our own for the families this server runs natively (llama.py),
its layers, attention contexts and key/value storage."""
