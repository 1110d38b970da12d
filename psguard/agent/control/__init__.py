"""The agent's control plane: how people, orchestrators, Prometheus and other agents talk to it.

:mod:`.httpd` serves the endpoints (:mod:`.connections` takes each connection from the kernel's queue to the
thread that answers it), :mod:`.auth` says who may call them, :mod:`.metrics` is what
``/metrics`` exports, :mod:`.peers` is the chief's agent calling its PS agents (generations, ``/finish``),
and :mod:`.status` is ``psguard status``, the client of ``/status``.
"""
