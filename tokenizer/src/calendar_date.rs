//! The configured "today" of a chat template, and the `strftime` formatting templates apply to it.
//!
//! Hugging Face's `apply_chat_template` gives templates `strftime_now(fmt)`, which formats the engine's
//! wall clock (`datetime.now().strftime(fmt)`); Llama 3.x templates stamp `strftime_now("%d %b %Y")` into
//! the system header and gpt-oss's stamps `strftime_now("%Y-%m-%d")`. The router must render the same
//! text as the engine, so it cannot read its own clock independently: it formats the date the operator
//! configures (`tokenizer.current_date`), and only the date. Time-of-day directives are refused (a
//! render error, so the request falls back) rather than invented.

use core::fmt;

/// A proleptic Gregorian calendar date, years 1 to 9999 (Python's `datetime.date` range).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CalendarDate {
    year: u16,
    month: u8,
    day: u8,
}

/// Why a `current_date` setting or a `strftime` format was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DateError(pub String);

impl fmt::Display for DateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
/// Monday first, as Python's `date.weekday()` counts.
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

fn is_leap(year: u16) -> bool {
    (year.is_multiple_of(4) && !year.is_multiple_of(100)) || year.is_multiple_of(400)
}

fn days_in_month(year: u16, month: u8) -> u8 {
    match month {
        2 if is_leap(year) => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    }
}

impl CalendarDate {
    /// Parses `YYYY-MM-DD` (ISO 8601 calendar date, the form the harmony header prints).
    pub fn parse(s: &str) -> Result<CalendarDate, DateError> {
        let bad = || DateError(format!("{s:?} is not a date of the form YYYY-MM-DD"));
        let b = s.as_bytes();
        if b.len() != 10 || b[4] != b'-' || b[7] != b'-' {
            return Err(bad());
        }
        let num = |r: core::ops::Range<usize>| -> Result<u16, DateError> {
            let part = &s[r];
            if !part.bytes().all(|c| c.is_ascii_digit()) {
                return Err(bad());
            }
            part.parse().map_err(|_| bad())
        };
        let (year, month, day) = (num(0..4)?, num(5..7)?, num(8..10)?);
        if year == 0 || !(1..=12).contains(&month) {
            return Err(bad());
        }
        let month = month as u8;
        if day == 0 || day > days_in_month(year, month) as u16 {
            return Err(bad());
        }
        Ok(CalendarDate {
            year,
            month,
            day: day as u8,
        })
    }

    /// Day of the year, 1-based.
    fn ordinal(&self) -> u16 {
        (1..self.month)
            .map(|m| days_in_month(self.year, m) as u16)
            .sum::<u16>()
            + self.day as u16
    }

    /// 0 = Monday .. 6 = Sunday. Days since 0001-01-01 (a Monday in the proleptic calendar).
    fn weekday(&self) -> usize {
        let y = self.year as u32 - 1;
        let days = y * 365 + y / 4 - y / 100 + y / 400 + self.ordinal() as u32 - 1;
        (days % 7) as usize
    }

    /// Formats like Python's `date.strftime` for the date directives: `%d %e %m %y %Y %b %B %h %a %A
    /// %j %u %w %F %D %x %%` (C locale), plus the glibc no-padding forms `%-d %-m %-j`, which
    /// `strftime` on Linux, where engines run, accepts. Time-of-day and unknown directives are an
    /// error: the configured date has no time, and guessing one would render text the engine does not.
    pub fn strftime(&self, fmt: &str) -> Result<String, DateError> {
        let mut out = String::with_capacity(fmt.len() + 16);
        let mut chars = fmt.chars();
        while let Some(c) = chars.next() {
            if c != '%' {
                out.push(c);
                continue;
            }
            let mut d = chars.next();
            let unpadded = d == Some('-');
            if unpadded {
                d = chars.next();
            }
            let Some(d) = d else {
                return Err(DateError(format!("strftime format {fmt:?} ends with '%'")));
            };
            let (y, m, day) = (self.year, self.month, self.day);
            let pad2 = |n: u16| {
                if unpadded {
                    n.to_string()
                } else {
                    format!("{n:02}")
                }
            };
            match d {
                'd' => out.push_str(&pad2(day as u16)),
                'e' if !unpadded => out.push_str(&format!("{day:>2}")),
                'm' => out.push_str(&pad2(m as u16)),
                'j' if unpadded => out.push_str(&self.ordinal().to_string()),
                'j' => out.push_str(&format!("{:03}", self.ordinal())),
                'y' if !unpadded => out.push_str(&format!("{:02}", y % 100)),
                'Y' if !unpadded => out.push_str(&format!("{y:04}")),
                'b' | 'h' if !unpadded => out.push_str(&MONTHS[m as usize - 1][..3]),
                'B' if !unpadded => out.push_str(MONTHS[m as usize - 1]),
                'a' if !unpadded => out.push_str(&WEEKDAYS[self.weekday()][..3]),
                'A' if !unpadded => out.push_str(WEEKDAYS[self.weekday()]),
                'u' if !unpadded => out.push_str(&(self.weekday() + 1).to_string()),
                'w' if !unpadded => out.push_str(&((self.weekday() + 1) % 7).to_string()),
                'F' if !unpadded => out.push_str(&format!("{y:04}-{m:02}-{day:02}")),
                'D' | 'x' if !unpadded => out.push_str(&format!("{m:02}/{day:02}/{:02}", y % 100)),
                '%' if !unpadded => out.push('%'),
                other => {
                    let dash = if unpadded { "-" } else { "" };
                    return Err(DateError(format!(
                        "strftime directive %{dash}{other} is not supported: the configured \
                         current_date has no time of day (supported: %d %e %m %y %Y %b %B %h %a %A \
                         %j %u %w %F %D %x %% and %-d %-m %-j)"
                    )));
                }
            }
        }
        Ok(out)
    }
}

impl fmt::Display for CalendarDate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04}-{:02}-{:02}", self.year, self.month, self.day)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(s: &str) -> CalendarDate {
        CalendarDate::parse(s).unwrap()
    }

    #[test]
    fn parses_iso_dates_and_refuses_the_rest() {
        assert_eq!(d("2026-11-29").to_string(), "2026-11-29");
        assert_eq!(d("2024-02-29").to_string(), "2024-02-29");
        for bad in [
            "2023-02-29",
            "1900-02-29",
            "2026-13-01",
            "2026-00-10",
            "2026-04-31",
            "0000-01-01",
            "2026-1-01",
            "26-11-29",
            "2026/11/29",
            "2026-11-2x",
            "+026-11-29",
            "",
            "2026-11-29T00:00",
        ] {
            assert!(CalendarDate::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn weekdays_match_the_calendar() {
        // Known dates: 2024-07-26 was a Friday, 2000-01-01 a Saturday, 2026-11-29 a Sunday,
        // 0001-01-01 a Monday (proleptic Gregorian), 2024-02-29 a Thursday.
        for (date, day) in [
            ("2024-07-26", "Friday"),
            ("2000-01-01", "Saturday"),
            ("2026-11-29", "Sunday"),
            ("0001-01-01", "Monday"),
            ("2024-02-29", "Thursday"),
            ("1970-01-01", "Thursday"),
        ] {
            assert_eq!(d(date).strftime("%A").unwrap(), day, "{date}");
        }
    }

    #[test]
    fn formats_the_date_directives() {
        let t = d("2024-07-06");
        assert_eq!(t.strftime("%d %b %Y").unwrap(), "06 Jul 2024");
        assert_eq!(t.strftime("%Y-%m-%d").unwrap(), "2024-07-06");
        assert_eq!(t.strftime("%-d %B %y").unwrap(), "6 July 24");
        assert_eq!(t.strftime("%e|%-m|%j|%-j").unwrap(), " 6|7|188|188");
        assert_eq!(t.strftime("%a %A %u %w").unwrap(), "Sat Saturday 6 6");
        assert_eq!(
            t.strftime("%F %D %x %h 100%%").unwrap(),
            "2024-07-06 07/06/24 07/06/24 Jul 100%"
        );
        assert_eq!(d("2026-11-29").strftime("%u %w").unwrap(), "7 0");
        assert_eq!(d("2026-01-01").strftime("%j").unwrap(), "001");
        assert_eq!(d("2024-12-31").strftime("%j").unwrap(), "366");
        assert_eq!(
            t.strftime("no directives: ünï").unwrap(),
            "no directives: ünï"
        );
    }

    #[test]
    fn refuses_time_of_day_and_unknown_directives() {
        let t = d("2024-07-06");
        for bad in [
            "%H:%M", "%S", "%p", "%c", "%Z", "%q", "%", "abc%", "%-Y", "%-",
        ] {
            assert!(t.strftime(bad).is_err(), "{bad}");
        }
    }
}
