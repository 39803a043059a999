use super::*;

#[test]
fn presets_fill_the_section_and_explicit_fields_win() {
    let c = RoutingConfig::from_json(r#"{"kv_load":{"preset":"ray_balanced"}}"#).unwrap();
    let k = &c.kv_load;
    assert_eq!(k.preset, Some(KvLoadPreset::RayBalanced));
    assert_eq!(
        (
            k.overlap_credit,
            k.overlap_credit_decay,
            k.active_request_weight
        ),
        (0.5, 1.0, 32.0)
    );
    assert!(k.assume_kv_reuse);
    // The moved `load` fields still come from the preset.
    assert!(c.load.use_output_hint && c.load.prompt_blocks_at_admission);
    assert_eq!(c.load.reported_load, ReportedLoad::Ignore);
    let c = RoutingConfig::from_json(
        r#"{"kv_load":{"preset":"ray_kv_biased","overlap_credit":3},"load":{"use_output_hint":false}}"#,
    )
    .unwrap();
    assert_eq!(c.kv_load.overlap_credit, 3.0);
    assert!(!c.load.use_output_hint);
    assert_eq!(c.kv_load.overlap_credit_decay, 0.0);
    let d = RoutingConfig::from_json(r#"{"kv_load":{"preset":"dynamo"}}"#).unwrap();
    assert_eq!(d.kv_load.overlap_credit, 1.0);
    // The presets are the published routers' formula: none has kvsteer's working-set term.
    for p in [
        KvLoadPreset::Dynamo,
        KvLoadPreset::RayBalanced,
        KvLoadPreset::RayKvBiased,
    ] {
        assert_eq!(p.params().overflow_weight, 0.0, "{p:?}");
    }
    assert_eq!(d.load.reported_load, ReportedLoad::Ignore);
    let e = RoutingConfig::from_json(r#"{"kv_load":{"preset":"sglang"}}"#).unwrap_err();
    assert_eq!(e.field, "kv_load.preset", "{e}");
    let e = RoutingConfig::from_json(r#"{"kv_load":{"reported_load":"min"}}"#).unwrap_err();
    assert_eq!(e.field, "kv_load.reported_load", "{e}");
    let e = RoutingConfig::from_json(r#"{"load":{"reported_load":"min"}}"#).unwrap_err();
    assert_eq!(e.field, "load.reported_load", "{e}");
    let e = RoutingConfig::from_json(r#"{"kv_load":{"overlap_credit_decay":-1}}"#).unwrap_err();
    assert_eq!(e.field, "kv_load.overlap_credit_decay", "{e}");
    let e = RoutingConfig::from_json(r#"{"kv_load":{"overflow_reuse_floor":1.5}}"#).unwrap_err();
    assert_eq!(e.field, "kv_load.overflow_reuse_floor", "{e}");
    for bad in ["0", "12", "2048", "-8", "8.5"] {
        let json = format!(r#"{{"working_set":{{"sample":{bad}}}}}"#);
        let e = RoutingConfig::from_json(&json).unwrap_err();
        assert_eq!(e.field, "working_set.sample", "{bad}: {e}");
        // Under the old name: a value out of range is refused under the new name, one of the
        // wrong type under the name it was given.
        let json = format!(r#"{{"kv_load":{{"working_set_sample":{bad}}}}}"#);
        let e = RoutingConfig::from_json(&json).unwrap_err();
        assert!(
            ["working_set.sample", "kv_load.working_set_sample"].contains(&e.field.as_str()),
            "{bad}: {e}"
        );
    }
    let c = RoutingConfig::from_json(r#"{"working_set":{"sample":32}}"#).unwrap();
    assert_eq!(c.working_set.sampling().one_in_n(), 32);
    let c = RoutingConfig::from_json(r#"{"kv_load":{"working_set_sample":32}}"#).unwrap();
    assert_eq!(c.working_set.sampling().one_in_n(), 32);
    assert_eq!(
        RoutingConfig::default().working_set.sampling().one_in_n(),
        8
    );
}

#[test]
fn empty_is_default_and_fields_parse() {
    assert_eq!(
        RoutingConfig::from_json("{}").unwrap(),
        RoutingConfig::default()
    );
    let c = RoutingConfig::from_json(
        r#"{"policy":"session_hash","block_size":64,"kv_load":{"temperature":0.5},
            "session_hash":{"virtual_nodes":50}}"#,
    )
    .unwrap();
    assert_eq!(c.policy, PolicyKind::SessionHash);
    assert_eq!(c.block_size, 64);
    assert_eq!(c.kv_load.temperature, 0.5);
    assert_eq!(c.kv_load.queue_weight, 0.25, "the default kept");
    assert!(c.kv_load.time_cost, "the default kept");
    assert_eq!(c.session_hash.virtual_nodes, 50);
}

#[test]
fn errors_name_the_field() {
    let e = RoutingConfig::from_json(r#"{"polcy":"kv_load"}"#).unwrap_err();
    assert_eq!(e.field, "polcy", "{e}");
    let e = RoutingConfig::from_json(r#"{"kv_load":{"temprature":1}}"#).unwrap_err();
    assert_eq!(e.field, "kv_load.temprature", "{e}");
    let e = RoutingConfig::from_json(r#"{"kv_load":{"temperature":"hot"}}"#).unwrap_err();
    assert_eq!(e.field, "kv_load.temperature", "{e}");
    let e = RoutingConfig::from_json(r#"{"policy":"fastest"}"#).unwrap_err();
    assert_eq!(e.field, "policy", "{e}");
    let e = RoutingConfig::from_json(r#"{"block_size":0}"#).unwrap_err();
    assert_eq!(e.field, "block_size");
    let e = RoutingConfig::from_json(r#"{"kv_load":{"temperature":-1}}"#).unwrap_err();
    assert_eq!(e.field, "kv_load.temperature");
    let e = RoutingConfig::from_json(r#"{"index":{"host_tier_credit":2}}"#).unwrap_err();
    assert_eq!(e.field, "index.host_tier_credit");
    assert!(RoutingConfig::from_json("[").is_err());
    assert!(e.to_string().contains("index.host_tier_credit"));
    // Under its old name the value is checked in its new place.
    let e = RoutingConfig::from_json(r#"{"kv_load":{"disk_tier_credit":-1}}"#).unwrap_err();
    assert_eq!(e.field, "index.disk_tier_credit");
    let e = RoutingConfig::from_json(r#"{"index":{"gpu_tier_credit":1}}"#).unwrap_err();
    assert_eq!(e.field, "index.gpu_tier_credit", "{e}");
}

#[test]
fn tier_credits_moved_to_index_and_the_old_names_still_apply_with_a_warning() {
    let d = RoutingConfig::default();
    assert_eq!(
        (d.index.host_tier_credit, d.index.disk_tier_credit),
        (0.75, 0.25)
    );
    assert!(
        RoutingConfig::from_json("{}")
            .unwrap()
            .warnings()
            .is_empty()
    );
    // The new place: applies, no warning.
    let c = RoutingConfig::from_json(r#"{"index":{"host_tier_credit":0.5,"disk_tier_credit":0}}"#)
        .unwrap();
    assert_eq!(
        (c.index.host_tier_credit, c.index.disk_tier_credit),
        (0.5, 0.0)
    );
    assert!(c.warnings().is_empty(), "{:?}", c.warnings());
    // The old name: applies (under every policy, kv_time the default) and warns, naming the new place.
    let c = RoutingConfig::from_json(r#"{"kv_load":{"host_tier_credit":0.5}}"#).unwrap();
    assert_eq!(c.policy, PolicyKind::KvTime);
    assert_eq!(
        (c.index.host_tier_credit, c.index.disk_tier_credit),
        (0.5, 0.25)
    );
    let w = c.warnings();
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(
        w[0].contains("kv_load.host_tier_credit") && w[0].contains("index.host_tier_credit"),
        "{w:?}"
    );
    // One field old, the other new: each applies, the old one warns.
    let c = RoutingConfig::from_json(
        r#"{"kv_load":{"disk_tier_credit":0.1},"index":{"host_tier_credit":0.9}}"#,
    )
    .unwrap();
    assert_eq!(
        (c.index.host_tier_credit, c.index.disk_tier_credit),
        (0.9, 0.1)
    );
    assert_eq!(c.warnings().len(), 1);
    // Both names for one field: refused, naming the new place.
    let e = RoutingConfig::from_json(
        r#"{"kv_load":{"host_tier_credit":0.5},"index":{"host_tier_credit":0.5}}"#,
    )
    .unwrap_err();
    assert_eq!(e.field, "index.host_tier_credit", "{e}");
    assert!(e.message.contains("kv_load.host_tier_credit"), "{e}");
    // A preset leaves the credits alone, as before; beside it the old name still applies.
    for p in ["dynamo", "ray_balanced", "ray_kv_biased"] {
        let json = format!(r#"{{"kv_load":{{"preset":"{p}"}}}}"#);
        let c = RoutingConfig::from_json(&json).unwrap();
        assert_eq!(c.index, IndexParams::default(), "{p}");
        let json = format!(r#"{{"kv_load":{{"preset":"{p}","disk_tier_credit":0.5}}}}"#);
        let c = RoutingConfig::from_json(&json).unwrap();
        assert_eq!(c.index.disk_tier_credit, 0.5, "{p}");
        assert_eq!(
            c.kv_load,
            KvLoadPreset::params(c.kv_load.preset.unwrap()),
            "{p}"
        );
    }
}

#[test]
fn load_fields_moved_to_load_and_the_old_names_still_apply_with_a_warning() {
    let d = RoutingConfig::default();
    assert_eq!(
        d.load,
        LoadParams {
            reported_load: ReportedLoad::Ignore,
            prompt_blocks_at_admission: true,
            use_output_hint: false,
        }
    );
    // The new place: applies, no warning.
    let new = r#"{"load":{"reported_load":"others","prompt_blocks_at_admission":false,"use_output_hint":true}}"#;
    let c = RoutingConfig::from_json(new).unwrap();
    let want = LoadParams {
        reported_load: ReportedLoad::Others,
        prompt_blocks_at_admission: false,
        use_output_hint: true,
    };
    assert_eq!(c.load, want);
    assert!(c.warnings().is_empty(), "{:?}", c.warnings());
    // The old names: the same values, one warning each naming the new place.
    let old = r#"{"kv_load":{"reported_load":"others","prompt_blocks_at_admission":false,"use_output_hint":true}}"#;
    let c = RoutingConfig::from_json(old).unwrap();
    assert_eq!(c.policy, PolicyKind::KvTime);
    assert_eq!(c.load, want);
    let w = c.warnings();
    assert_eq!(w.len(), 3, "{w:?}");
    for f in [
        "reported_load",
        "prompt_blocks_at_admission",
        "use_output_hint",
    ] {
        assert!(
            w.iter()
                .any(|l| l.starts_with(&format!("kv_load.{f} is deprecated"))
                    && l.contains(&format!("set load.{f} instead"))),
            "{f}: {w:?}"
        );
    }
    // Both names for one field: refused, naming the new place.
    let e = RoutingConfig::from_json(
        r#"{"kv_load":{"reported_load":"merge"},"load":{"reported_load":"merge"}}"#,
    )
    .unwrap_err();
    assert_eq!(e.field, "load.reported_load", "{e}");
    assert!(e.message.contains("kv_load.reported_load"), "{e}");
    let e = RoutingConfig::from_json(
        r#"{"kv_load":{"use_output_hint":true},"load":{"use_output_hint":false}}"#,
    )
    .unwrap_err();
    assert_eq!(e.field, "load.use_output_hint", "{e}");
    let e = RoutingConfig::from_json(r#"{"load":{"queue_weight":1}}"#).unwrap_err();
    assert_eq!(e.field, "load.queue_weight", "{e}");
}

/// A preset sets the `load` fields as it did under `kv_load` (Dynamo's accounting, scored on the
/// router's own bookings, decode progress in Ray's presets); `load`, or the old name, overrides it.
#[test]
fn presets_still_supply_the_load_fields() {
    for (p, hint) in [
        ("dynamo", false),
        ("ray_balanced", true),
        ("ray_kv_biased", true),
    ] {
        let want = LoadParams {
            reported_load: ReportedLoad::Ignore,
            prompt_blocks_at_admission: true,
            use_output_hint: hint,
        };
        let c = RoutingConfig::from_json(&format!(r#"{{"kv_load":{{"preset":"{p}"}}}}"#)).unwrap();
        assert_eq!(c.load, want, "{p}");
        assert_eq!(c.kv_load.preset.unwrap().load(), want, "{p}");
        assert_eq!(
            c.kv_load,
            KvLoadPreset::params(c.kv_load.preset.unwrap()),
            "{p}"
        );
        assert_eq!(c.working_set, WorkingSetParams::default(), "{p}");
        assert!(c.warnings().is_empty(), "{p}");
        // Given in `load`: wins over the preset, the rest still the preset's.
        let c = RoutingConfig::from_json(&format!(
            r#"{{"kv_load":{{"preset":"{p}"}},"load":{{"use_output_hint":{},"reported_load":"max"}}}}"#,
            !hint
        ))
        .unwrap();
        assert_eq!(
            c.load,
            LoadParams {
                reported_load: ReportedLoad::Max,
                use_output_hint: !hint,
                ..want.clone()
            },
            "{p}"
        );
        assert!(c.warnings().is_empty(), "{p}");
        // Given beside the preset under the old name: wins too, as before, with a warning.
        let c = RoutingConfig::from_json(&format!(
            r#"{{"kv_load":{{"preset":"{p}","prompt_blocks_at_admission":false}}}}"#
        ))
        .unwrap();
        assert_eq!(
            c.load,
            LoadParams {
                prompt_blocks_at_admission: false,
                ..want.clone()
            },
            "{p}"
        );
        assert_eq!(c.warnings().len(), 1, "{p}");
    }
}

#[test]
fn working_set_fields_moved_to_working_set_and_the_old_names_still_apply_with_a_warning() {
    let d = RoutingConfig::default();
    assert_eq!(
        d.working_set,
        WorkingSetParams {
            window_ms: 120_000.0,
            sample: 8,
            from_feed: false,
        }
    );
    let want = WorkingSetParams {
        window_ms: 60_000.0,
        sample: 16,
        from_feed: true,
    };
    let c = RoutingConfig::from_json(
        r#"{"working_set":{"window_ms":60000,"sample":16,"from_feed":true}}"#,
    )
    .unwrap();
    assert_eq!(c.working_set, want);
    assert!(c.warnings().is_empty(), "{:?}", c.warnings());
    let c = RoutingConfig::from_json(
        r#"{"kv_load":{"working_set_window_ms":60000,"working_set_sample":16,"working_set_from_feed":true}}"#,
    )
    .unwrap();
    assert_eq!(c.working_set, want);
    let w = c.warnings();
    assert_eq!(w.len(), 3, "{w:?}");
    for (old, new) in [
        ("working_set_window_ms", "window_ms"),
        ("working_set_sample", "sample"),
        ("working_set_from_feed", "from_feed"),
    ] {
        assert!(
            w.iter()
                .any(|l| l.starts_with(&format!("kv_load.{old} is deprecated"))
                    && l.contains(&format!("set working_set.{new} instead"))),
            "{old}: {w:?}"
        );
    }
    // One old, one new: each applies.
    let c = RoutingConfig::from_json(
        r#"{"kv_load":{"working_set_from_feed":true},"working_set":{"window_ms":1000}}"#,
    )
    .unwrap();
    assert_eq!(
        (c.working_set.window_ms, c.working_set.from_feed),
        (1000.0, true)
    );
    assert_eq!(c.warnings().len(), 1);
    let e = RoutingConfig::from_json(
        r#"{"kv_load":{"working_set_window_ms":1000},"working_set":{"window_ms":1000}}"#,
    )
    .unwrap_err();
    assert_eq!(e.field, "working_set.window_ms", "{e}");
    assert!(e.message.contains("kv_load.working_set_window_ms"), "{e}");
    let e = RoutingConfig::from_json(r#"{"kv_load":{"working_set_window_ms":-1}}"#).unwrap_err();
    assert_eq!(e.field, "working_set.window_ms", "{e}");
    let e = RoutingConfig::from_json(r#"{"working_set":{"window":1}}"#).unwrap_err();
    assert_eq!(e.field, "working_set.window", "{e}");
}

#[test]
fn least_load_has_its_own_weights_that_kv_load_does_not_move() {
    let c = RoutingConfig::from_json(
        r#"{"policy":"least_load","kv_load":{"preset":"dynamo","active_request_weight":5}}"#,
    )
    .unwrap();
    assert_eq!(c.kv_load.prefill_scale, 1.0);
    assert_eq!(c.least_load, LeastLoadParams::default());
    assert_eq!(c.least_load.prefill_scale, 16.0);
    let c = RoutingConfig::from_json(r#"{"least_load":{"prefill_scale":4}}"#).unwrap();
    assert_eq!(c.least_load.prefill_scale, 4.0);
    assert_eq!(c.kv_load.prefill_scale, 16.0);
    for bad in [
        r#"{"least_load":{"prefill_scale":-1}}"#,
        r#"{"least_load":{"active_request_weight":-0.5}}"#,
        r#"{"least_load":{"queue_weight":1}}"#,
    ] {
        let e = RoutingConfig::from_json(bad).unwrap_err();
        assert!(e.field.starts_with("least_load."), "{bad}: {e}");
    }
}
