"""MQTT transport: connection, on-disk outbox, update upload, model download, brokers.

    mqtt     MqttClient (paho 2.x, MQTT 3.1.1, QoS 1, TLS, will, full-jitter reconnect)
    channel  Channel: verified receive / signed send / refusals, over an MqttClient
    outbox   Outbox: persistent, bounded store of chunked updates until acknowledged
    uplink   Uploader (device) and UpdateReceiver (coordinator) for update chunks
    models   publish_model (coordinator) and ModelDownload (device) for model bundles
    broker   MosquittoBroker / EmbeddedBroker (amqtt) for tests, local runs and the demo

Nothing here imports numpy or MXNet: the idle agent daemon stays small.
"""

from .channel import Admission, Channel
from .mqtt import MqttClient, Received, TlsConfig, Will
from .outbox import Outbox, OutboxFullError, OutboxItem, OutboxKey
from .uplink import UpdateReceiver, Uploader, ack_message

__all__ = [
    "Admission", "Channel", "MqttClient", "Outbox", "OutboxFullError", "OutboxItem", "OutboxKey", "Received",
    "TlsConfig", "UpdateReceiver", "Uploader", "Will", "ack_message",
]
