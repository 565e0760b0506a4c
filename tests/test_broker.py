"""The embedded broker never hands a consumer a message that is still being written."""

import threading
from pathlib import Path

from kombu import Connection


def test_filesystem_messages_are_whole_or_absent(tmp_path: Path) -> None:
    (tmp_path / "processed").mkdir()
    (tmp_path / "control").mkdir()
    options = {
        "data_folder_in": str(tmp_path),
        "data_folder_out": str(tmp_path),
        "store_processed": False,
        "processed_folder": str(tmp_path / "processed"),
        "control_folder": str(tmp_path / "control"),
        "polling_interval": 0.001,
    }
    transport = "ptcproject.broker:FilesystemTransport"
    count, body = 300, {"payload": "x" * 200_000}  # big enough that a write takes a while
    received: list[dict] = []

    def consume() -> None:
        with Connection(transport=transport, transport_options=options) as conn:
            queue = conn.SimpleQueue("race")
            while len(received) < count:
                message = queue.get(timeout=10)
                received.append(message.payload)
                message.ack()

    # Bound once before the race: kombu keeps bindings per process, so a thread that finds the
    # binding known would publish before the exchange table is written, and to no queue.
    with Connection(transport=transport, transport_options=options) as conn:
        conn.SimpleQueue("race").close()
    consumer = threading.Thread(target=consume)
    consumer.start()
    with Connection(transport=transport, transport_options=options) as conn:
        queue = conn.SimpleQueue("race")
        for _ in range(count):
            queue.put(body)
    consumer.join(30)
    assert len(received) == count
    assert all(message == body for message in received)
