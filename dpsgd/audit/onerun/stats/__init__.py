"""The one-run audit's statistics, pure functions of scores, bits and a claim: the family-free bound
of Steinke et al. (``bounds``), the test of the claim within its family (``family``), the
order-statistics bound of Xiang et al. (``order_stats``), the exact noise test (``noise_check``) and
the idealised game they are checked on (``simulate``)."""
