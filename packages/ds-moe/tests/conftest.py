"""The rank workers of this suite build torch optimizers, and the first one a process builds
imports ``torch._dynamo`` (seconds): the fork server imports it once, before forking them."""

from ds_testing import preload

preload("torch._dynamo")
