"""Cluster plan: a job's step time, throughput and memory on GPUs this machine does not have
(``pipetrain plan --cluster``): the hardware, its kernels and collectives, a layer's cost, the
search over layouts, and the published runs it is checked against."""
