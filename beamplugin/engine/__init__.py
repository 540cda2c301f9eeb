"""The decoding engine and its parts: requests in, a scheduler that admits them, the slots of
the sentences in flight, the model runner that encodes and decodes, the finalizer that keeps
finished hypotheses, and the coordinator whose step ties them together."""

from beamplugin.engine.choice import engine_for, open_engine
from beamplugin.engine.device_engine import DeviceEngine
from beamplugin.engine.engine import Decoder, DecodingEngine
from beamplugin.engine.requests import Finished, Request

__all__ = [
    "Decoder", "DecodingEngine", "DeviceEngine", "Finished", "Request", "engine_for", "open_engine",
]
