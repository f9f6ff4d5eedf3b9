"""foreserve's entry points: the ``foreserve`` command (``cli``), ``foreserve prepare``'s body
(``prepare``) and the batch job's driver and actors (``batch``). They sit above every other
package (docs/layers.md): they start processes, read the environment and wire the pieces."""
