"""Tools that measure the kernels without a GPU, outside the runtime that
they measure: ``launches`` counts what a GPU would be sent (launches, host
waits), ``sm90`` compiles each launched variant for sm_90 and reads its
registers and spills. The runtime knows nothing of them: ``launches`` adds
itself to the Triton backend's launch observers (``launcher.OBSERVERS``, empty by
default) while it counts."""
