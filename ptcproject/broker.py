"""kombu's transports, with two defects worked around, and one cost.

Filesystem (the embedded default): kombu writes a message into its final file name, so a consumer
listing the folder can take the file before its content is written, read nothing, and die on the
JSON (Celery calls that unrecoverable). Here a message is written under another name and renamed
into place: a rename is atomic, so a consumer sees a whole message or none. And a reader can find
an exchange table that kombu has created but not yet written (empty): it reads again shortly.

Redis:

When a worker loses its broker connection while it holds an unacknowledged message (an exec job
runs for its whole life with ``acks_late``), kombu closes the channel, then tries to restore that
message, and later to ack it, through the connection it has dropped. Both raise ``AttributeError``
('NoneType' object has no attribute 'hostname' / 'client'), which Celery treats as unrecoverable:
the worker exits and takes every running job with it. Here both are logged and the worker goes on;
a message left in Redis's unacked set is restored after ``visibility_timeout`` as usual, and our
tasks find their record already claimed, so a restore never runs anything twice. And kombu made a
new Redis client for every message it sent, kept track of or acked: here one per connection pool.
"""

import logging
import os
import time
import uuid
from time import monotonic
from typing import Any

from kombu.transport import filesystem, redis
from kombu.utils.json import dumps

logger = logging.getLogger("ptc.broker")
# How often a reader tries an exchange table that is still being written (5 ms apart).
TABLE_READ_TRIES = 200


class QoS(redis.QoS):
    def restore_unacked(self, client: Any = None) -> None:
        try:
            super().restore_unacked(client)
        except AttributeError:
            logger.warning("could not restore unacked messages on a lost connection; visibility timeout will")
            self._delivered.clear()

    def ack(self, delivery_tag: Any) -> None:
        try:
            super().ack(delivery_tag)
        except AttributeError:
            logger.warning("could not ack a message on a lost connection; its record already says how it ended")

    def reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        try:
            super().reject(delivery_tag, requeue=requeue)
        except AttributeError:
            logger.warning("could not reject a message on a lost connection")


class Channel(redis.Channel):
    QoS = QoS
    _sync_client: Any = None

    def _create_client(self, asynchronous: bool = False) -> Any:
        # kombu builds a new client (redis-py's Redis(), ~70 us of CPU) for every publish, and for
        # every delivered message's unacked bookkeeping and its ack: one client per pool serves
        # them all (redis-py's clients are thread-safe; each command takes a pooled connection).
        if asynchronous:
            return super()._create_client(asynchronous=True)
        client = self._sync_client
        if client is None or client.connection_pool is not self.pool:
            client = self._sync_client = super()._create_client()
        return client


class Transport(redis.Transport):
    Channel = Channel


class FilesystemChannel(filesystem.Channel):
    # kombu's own filesystem.Channel._put, which this overrides, names AbstractChannel's ``message``
    # ``payload``: no one name satisfies both, and every caller passes it by position.
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:  # type: ignore[override]
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        final = os.path.join(self.data_folder_out, name)
        partial = f"{final}.part"  # not "<queue>.msg": no consumer takes it
        with open(partial, "wb") as handle:
            handle.write(dumps(payload).encode())
        os.replace(partial, final)

    def get_table(self, exchange: str) -> Any:
        # kombu creates a new exchange table with open("wb") before it locks and writes it, so a
        # reader can lock and read the empty file in between. Empty means "being written": the
        # writer takes its lock at once, so read again shortly.
        for _ in range(TABLE_READ_TRIES):
            try:
                return super().get_table(exchange)
            except ValueError:  # JSONDecodeError of the empty file
                time.sleep(0.005)
        return super().get_table(exchange)


class FilesystemTransport(filesystem.Transport):
    Channel = FilesystemChannel
