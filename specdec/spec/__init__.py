"""Speculation's home: the draft tree, the policies that alone decide each request's draft
budget (fixed, adaptive, the cost model), verification and its rejection samplers, and the
drafts a grammar forces. Drafters live in specdec.drafters, behind `Drafter`."""
