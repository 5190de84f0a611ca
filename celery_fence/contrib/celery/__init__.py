"""celery-fence for Celery: fenced tasks, epochs in headers and an HA beat scheduler.

from celery import Celery
from celery_fence.contrib.celery import Fence

app = Celery("docs", broker="redis://127.0.0.1:6379/0")
app.conf.fence_database_url = "postgresql://postgres@127.0.0.1/test"
fence = Fence(app)

@fence.task(lease="release:{environment}", bind=True)
def publish(self, environment, release_id):
    with fence.guard("publish manifest") as conn:
        conn.execute(...)
"""

from .fence import REJECTED, SKIPPED, Fence, FencedRun, FencedTask, current_run
from .headers import HEADER, FenceHeader, MalformedHeaderError
from .settings import FenceSettings

__all__ = [
    "HEADER",
    "REJECTED",
    "SKIPPED",
    "Fence",
    "FenceHeader",
    "FenceSettings",
    "FencedRun",
    "FencedTask",
    "MalformedHeaderError",
    "current_run",
]
