"""The instance runtime of a box: the activator and its admission, the process tree and its cgroups, stop
evidence, the host guard, stamps, the route registry, timers and sleep (spec §5, §6.4, §9)."""
