"""A cluster in a box: emulated machines on one Linux host, each a network namespace with its own address, a
link shaped to a rate, and cores of its own, joined by a bridge; a job started on all of them under elastic
torchrun; partitions and lost machines on cue. docs/lab.md shows the command and what it emulates.

The lab drives iproute2's `ip` and `tc` (and util-linux's `taskset`) through subprocess rather than a netlink
library: they come with every Linux distribution, so the lab needs no package beyond the project's, and each
step is a command its users can read in the code, type themselves and look up in the man pages. The venv has
no netlink library (pyroute2) to prefer, and Mininet would bring a controller and Open vSwitch for what one
bridge does.

Modules:
    spec: parsing of rates, cores and faults (no side effects).
    privileges: what the lab needs, checked before anything is made.
    network: the namespaces, bridge, links and their teardown (`Lab`).
    job: one torchrun job on every machine, with faults (`run_job`).
"""
