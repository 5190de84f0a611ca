"""kombu's filesystem broker, with messages that appear in the folder whole.

kombu's filesystem transport creates a message file and then writes it, and a consumer polling
the folder may take the file in between, read it empty and lose the message. This channel writes
each message under a name consumers ignore and renames it into place: a rename within one folder
is atomic, so a consumer only ever finds whole messages. The demo uses it for ``filesystem://``.
"""

from __future__ import annotations

import os
import uuid
from time import monotonic
from typing import Any

from kombu.exceptions import ChannelError
from kombu.transport import filesystem
from kombu.utils.json import dumps


class Channel(filesystem.Channel):
    def _put(self, queue: str, payload: Any, **kwargs: Any) -> None:
        # The name kombu gives a message: the reader sorts by it and picks by its queue suffix.
        name = f"{round(monotonic() * 1000)}_{uuid.uuid4()}.{queue}.msg"
        partial = os.path.join(self.data_folder_out, f".{name}.part")
        try:
            with open(partial, "wb") as file:
                file.write(dumps(payload).encode())
            os.replace(partial, os.path.join(self.data_folder_out, name))
        except OSError as exc:
            raise ChannelError(f"Cannot add file {name!r} to directory") from exc


class Transport(filesystem.Transport):
    Channel = Channel
