# The example app's image: celery-fence with its Celery extra, and example_app beside it.
# docker-compose.yml builds it once and runs every app service from it.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PYTHONPATH=/app
WORKDIR /app

COPY pyproject.toml README.md ./
COPY celery_fence ./celery_fence
COPY sql ./sql
RUN pip install --no-cache-dir ".[celery]"

COPY example_app ./example_app
RUN useradd --system --no-create-home example
USER example

CMD ["python", "-m", "example_app", "--help"]
