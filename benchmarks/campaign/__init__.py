"""The fault campaign (issue 31): one training job, a seeded schedule of the faults real runs meet, played
loop on and loop off beside a fault-free run; goodput, time to target, detection, cost and false alarms in one
table. Run it with `python -m benchmarks.campaign` (see __main__.py); the method is in benchmarks/README.md.

Modules, one job each: `schedule` (the faults and where they fall), `operator` (the loop-off arm's on-call
person), `arm` (one run of the whole stack, recorded raw), `results` (ground truth and the table's figures).
"""
