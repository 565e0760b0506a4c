"""kombu's Redis transport, with one defect worked around.

When a worker loses its broker connection while it holds an unacknowledged message (an exec job
runs for its whole life with ``acks_late``), kombu closes the channel, then tries to restore that
message, and later to ack it, through the connection it has dropped. Both raise ``AttributeError``
('NoneType' object has no attribute 'hostname' / 'client'), which Celery treats as unrecoverable:
the worker exits and takes every running job with it. Here both are logged and the worker goes on;
a message left in Redis's unacked set is restored after ``visibility_timeout`` as usual, and our
tasks find their record already claimed, so a restore never runs anything twice.
"""

import logging
from typing import Any

from kombu.transport import redis

logger = logging.getLogger("ptc.broker")


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


class Transport(redis.Transport):
    Channel = Channel
