"""The NATS JetStream sink (nats-py): publish with `Nats-Msg-Id`, acknowledged by the stream."""
