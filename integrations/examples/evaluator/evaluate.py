"""An evaluator beside a running PS job: it follows the job's checkpoint log and evaluates each new checkpoint.

It holds its own copy of the model on one machine (no PS), kept at the job's newest checkpoint by
psguard.Follower: each new checkpoint costs the rows that changed, not the whole model. After each one it
evaluates on a held-out set and writes TensorBoard scalars (eval/loss, eval/lag_seconds) and serves a Prometheus
gauge of its lag, so an alert can say when evaluation falls behind training.

    pip install tensorboard      # tf.summary needs it; tensorflow-cpu does not bring it
    python evaluate.py --checkpoint-dir s3://bucket/job-42 --logdir /tmp/eval --metrics-port 9464

The model class is the trainer's (integrations/examples/custom_loop); the follower ignores the optimizer's
slots, which an evaluator does not need.
"""

import argparse
import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import tensorflow as tf

import psguard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "custom_loop"))
from train_psguard import BATCH, VOCAB, Model  # noqa: E402  (the trainer's model, as the job defines it)


class Lag:
    """The Prometheus gauge ``psguard_evaluator_lag_seconds`` and the step it was measured at."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seconds = float("nan")
        self.step = -1

    def render(self) -> bytes:
        with self.lock:
            return (
                "# HELP psguard_evaluator_lag_seconds Seconds from a checkpoint's commit to its evaluation.\n"
                "# TYPE psguard_evaluator_lag_seconds gauge\n"
                f"psguard_evaluator_lag_seconds {self.seconds}\n"
                "# HELP psguard_evaluator_step Step of the checkpoint evaluated last.\n"
                "# TYPE psguard_evaluator_step gauge\n"
                f"psguard_evaluator_step {self.step}\n"
            ).encode()


def serve_metrics(lag: Lag, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = lag.render() if self.path == "/metrics" else b""
            self.send_response(200 if body else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("0.0.0.0", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def held_out(seed: int = 7) -> tuple[tf.Tensor, tf.Tensor]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, size=(8 * BATCH, 2))
    labels = (ids.sum(axis=1) % 3 == 0).astype(np.float32)
    return tf.constant(ids), tf.constant(labels)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoint-dir", required=True, help="the job's store URL")
    parser.add_argument("--logdir", required=True, help="TensorBoard folder")
    parser.add_argument("--metrics-port", type=int, default=9464, help="Prometheus /metrics (0: do not serve)")
    parser.add_argument("--poll-interval", type=float, default=5.0)
    parser.add_argument("--until-step", type=int, help="stop after evaluating this step (for tests and backfills)")
    args = parser.parse_args()

    model = Model()
    follower = psguard.Follower(
        tf.train.Checkpoint(model=model), args.checkpoint_dir, poll_interval=args.poll_interval,
        ignore_missing=("optimizer",),
    )
    ids, labels = held_out()
    writer = tf.summary.create_file_writer(args.logdir)
    lag = Lag()
    server = serve_metrics(lag, args.metrics_port) if args.metrics_port else None
    stop = threading.Event()

    def evaluate(info: psguard.store.CheckpointInfo) -> None:
        logits = model(ids)
        loss = float(tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels, logits=logits)))
        seconds = follower.stats.lag_seconds or 0.0
        with lag.lock:
            lag.seconds, lag.step = seconds, info.step
        with writer.as_default(step=info.step):
            tf.summary.scalar("eval/loss", loss)
            tf.summary.scalar("eval/lag_seconds", seconds)
        writer.flush()
        print(json.dumps({"step": info.step, "loss": loss, "lag_seconds": seconds,
                          "bytes_read": follower.stats.bytes_read}), flush=True)
        if args.until_step is not None and info.step >= args.until_step:
            stop.set()

    try:
        follower.run(on_checkpoint=evaluate, stop=stop)
    finally:
        follower.close()
        if server is not None:
            server.shutdown()


if __name__ == "__main__":
    main()
