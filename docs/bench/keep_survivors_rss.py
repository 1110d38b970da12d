"""Why `peers.keep_survivors` is off: a kept PS's memory grows with psguard's manager, not without it.

A 2-PS LocalCluster (one worker), the chaos demo's model (2,000,000 x 8, Adagrad: 64 MB per PS), a sidecar
(memory tier, persister, spool server) in threads, `run_with_recovery`; every 40 chunks of 5 steps ps:0 is
SIGKILLed and only ps:0 is restarted, so ps:1 survives every generation. Prints ps:1's RSS and its mappings of
1 MB or more (size in MB -> count) per generation. Modes: `full` (saves and restores), `nosave` (no manager at
all), `norestore` (saves, never restores), `restoreonly` (saves in the first generation only, restores in each),
`manageronly` (a manager that never saves nor restores). 2026-12-06, GLIBC_TUNABLES as a PS agent sets them
(`glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=4194304`), ps:1's RSS per generation:

    nosave       449 443 464 446 456 456          flat
    manageronly  463 481 474 467 475              flat
    norestore    528 671 731 739 791 843          +60/generation
    restoreonly  539 688 825 867 939 988          +90
    full         537 694 810 888 941 1002         +93

The growth is in mappings of 61-63 MB (glibc's arena heaps: small blocks live or stranded), one or two more per
generation; `glibc.malloc.arena_max=2` did not stop it; clearing psguard's cached capture functions between
generations (`CLEARFN=1`) did not either (+73). The trainer holds no old variable (live variables counted at each
build: the same). Found with gc referrers (2026-12-06, restoreonly): the chief holds 24 more variable handles on ps:1 per
generation (10 -> 34 -> 58) in the captures of `tf.cond` branch graphs (`cond_true_*`, `cond_false_*`,
`cond_cond_*`, some traced in later generations) reachable from the functions psguard keeps across generations:
clearing `psguard.trainer.capture_graph._FUNCTIONS` and `psguard.trainer.recovery._TOUCH` at each recovery keeps
the handles at 10. Which function traces those conds per generation is not pinned down: the cached capture and
rebase functions themselves were traced once (`experimental_get_tracing_count()` 1 in every generation). An
anonymous variable lives on its PS as long as a handle to it does, so the old generations' shards stay on a kept
PS. With the caches cleared the handles stay at 10, but ps:1 still grew ~64 MB per generation (545 -> 737 over three): the functions instantiated
again on the survivor each generation, presumably (its eager context keeps every function registered). Direction:
trace those functions with the variables as real arguments (no eager handle captured in a branch), so that one
instantiation serves every generation and holds none of them. Run (from the repository, TF quiet):

    PYTHONPATH=. GLIBC_TUNABLES=glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=4194304 \
        python docs/bench/keep_survivors_rss.py /tmp/kept 5 restoreonly
"""
import gc, json, os, signal, sys, time
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3"); os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
from pathlib import Path
import tensorflow as tf
from psguard.agent.tiers.memory_tier import MemoryTier
from psguard.agent.tiers.persister import Persister, resume
from psguard.agent.tiers.spool_server import SpoolServer
from psguard.policy.engine import EverySteps, Schedule
from psguard.store import Store
from psguard.testbed.cluster import LocalCluster
from psguard.testbed.model import ModelConfig, RecModel, Trainer, make_optimizer
from psguard.trainer.manager import CheckpointManager
from psguard.trainer.options import ManagerOptions
from psguard.trainer.recovery import run_with_recovery

workdir = Path(sys.argv[1]); gens = int(sys.argv[2]); mode = sys.argv[3]
workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
def maps(pid):
    from collections import Counter
    c = Counter()
    cur = None
    for l in open(f"/proc/{pid}/smaps"):
        parts = l.split()
        if "-" in parts[0] and len(parts) >= 5 and ":" not in parts[0]:
            a, b = (int(x, 16) for x in parts[0].split("-"))
            cur = (b - a) >> 20 if len(parts) == 5 else None
        elif parts[0] == "Rss:" and cur is not None and cur >= 1:
            rss_mb = int(parts[1]) >> 10
            if rss_mb >= 1:
                c[cur] += 1
    return dict(sorted(c.items()))
def rss(pid):
    for l in open(f"/proc/{pid}/status"):
        if l.startswith("VmRSS"): return int(l.split()[1]) // 1024
url = str(workdir / "store"); spool = workdir / "spool"
store = Store.open(url); tier = MemoryTier()
persister = Persister(store, tier, last=resume(store, tier)).start()
server = SpoolServer(spool, tier, persister).start()
schedule = Schedule(memory=EverySteps(5), durable=EverySteps(50))
state = {"kills": 0, "models": []}
import weakref
with LocalCluster(num_ps=2, num_workers=1, standby=True) as cluster:
    strategy = tf.distribute.experimental.ParameterServerStrategy(cluster.cluster_resolver(),
        variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(2))
    coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
    cfg = ModelConfig(vocab_size=2_000_000, embedding_dim=8, batch_size=64)
    def build():
        with strategy.scope():
            model = RecModel(cfg); optimizer = make_optimizer("adagrad")
        trainer = Trainer(strategy, coordinator, model, optimizer)
        gc.collect()
        from tensorflow.python.ops import resource_variable_ops as rvo
        vs = [o for o in gc.get_objects() if isinstance(o, rvo.BaseResourceVariable)]
        print(json.dumps({"build": state["kills"], "old_models_alive": sum(r() is not None for r in state["models"]), "vars": len(vs), "big_mb": round(sum(v.shape.num_elements() * v.dtype.size for v in vs if v.shape.is_fully_defined() and v.shape.num_elements() > 100000) / 2**20)}), flush=True)
        state["models"].append(weakref.ref(model))
        manager = None
        if mode != "nosave":
            manager = CheckpointManager(tf.train.Checkpoint(model=model, optimizer=optimizer), url,
                step_counter=model.step, policy=schedule,
                options=ManagerOptions(coordinator=coordinator, spool=spool))
            if mode not in ("norestore", "manageronly"):
                manager.restore_or_initialize()
        trainer.next_index = int(model.step.numpy())
        return (model, trainer, manager)
    def train(job):
        model, trainer, manager = job
        n = 0
        while True:
            step = int(model.step.numpy())
            if manager is not None and mode != "manageronly" and not (mode == "restoreonly" and state["kills"] > 0):
                manager.maybe_save(step)
            trainer.train(5); n += 1
            if mode == "nosave" and n == 1: print(json.dumps({"gen_start": state["kills"]}), flush=True)
            if n == 40:
                print(json.dumps({"gen": state["kills"], "ps1_rss": rss(cluster.pids[("ps", 1)]), "ps0_rss": rss(cluster.pids[("ps", 0)]), "step": step, "ps1_maps": maps(cluster.pids[("ps", 1)])}), flush=True)
                if state["kills"] >= gens:
                    if manager is not None: manager.close()
                    return step
                cluster.fill_standby(); cluster.wait_standby()
                state["kills"] += 1
                os.kill(cluster.pids[("ps", 0)], signal.SIGKILL)
    def restart_ps(failed_at):
        if os.environ.get("CLEARFN"):
            from psguard.trainer import capture_graph, recovery as _rec
            capture_graph._FUNCTIONS.clear(); _rec._TOUCH.clear()
        cluster.restart("ps", 0)
    def close(job):
        if job[2] is not None: job[2].close(timeout=30)
    final, report = run_with_recovery(build, train, restart_ps=restart_ps, close=close)
    print(json.dumps({"final": final, "recoveries": len(report.recoveries), "ps1_rss": rss(cluster.pids[("ps", 1)])}), flush=True)
server.stop(); persister.stop(drain=True); store.close()
