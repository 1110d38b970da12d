"""The agent's control plane: :mod:`.httpd` (and :mod:`.connections`) serve the endpoints, :mod:`.auth` says who
may call them, :mod:`.metrics` is ``/metrics``, :mod:`.peers` the chief's agent calling its peers, :mod:`.status`
``psguard status``."""
