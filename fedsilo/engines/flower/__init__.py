"""Flower transport: a ServerApp and a ClientApp that are thin adapters over fedsilo's Server and
SiloClient. Nothing here weighs, optimises or selects: it only moves tensors and numbers."""
import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
