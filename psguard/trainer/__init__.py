"""The trainer's side: everything that runs inside the user's training process.

:class:`~psguard.trainer.manager.CheckpointManager`, the PS-side capture, restore and export, the Keras
callback, in-process recovery and preemption. It never imports :mod:`psguard.agent`: it talks to its agent
only through :mod:`psguard.handoff`.
"""
