

def test_the_evaluations_size_is_in_the_fingerprint_but_a_resume_may_change_it(tmp_path) -> None:
    from trainer.file_digests import FileDigests
    from trainer.run_identity import fingerprint, mismatch

    plan = cc.plan_variant(cc.variant_tasks(_request(tmp_path).task, ("one-pot",))["one-pot"],
                           ModelSpec(name="tiny", hf_config=CONFIG), load_hardware("cpu"))
    scored_on_2, scored_on_8 = (fingerprint(plan, plan.chosen.layout, cc.run_options(0, n), None, None, FileDigests())
                                for n in (2, 8))
    assert scored_on_2 != scored_on_8 and scored_on_2["scoring"]["eval_sequences"] == 2
    assert mismatch(scored_on_2, scored_on_8) is None
